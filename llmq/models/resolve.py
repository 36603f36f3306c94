"""Turn a model reference into a `model` artifact in the store, importing it once and reusing it afterwards.

A reference is: nothing (the embedded default model), a local GGUF file, a local Hugging Face directory, or a hub
id (downloaded for users with a network). Importing makes the model immutable and traceable: every later stage
names this artifact as its root parent.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..artifacts import Artifact, ArtifactNotFound, Store
from ..errors import LlmqError
from .checkpoint import (
    INDEX_NAME,
    copy_tokenizer,
    load_state_dict,
    pickle_files,
    read_config,
    safetensors_files,
    save_state_dict,
    write_json,
)
from .default import DEFAULT, PACKAGED, packaged_gguf
from .spec import SUPPORTED_ARCHITECTURES, ModelSpec, check_tensors

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._").lower()
    return (s or "model")[:100]


def _find_imported(store: Store, fingerprint: str) -> Artifact | None:
    for art in reversed(store.list(kind="model")):
        if art.config.get("source", {}).get("fingerprint") == fingerprint:
            return store.resolve(str(art.path))
    return None


def _dir_fingerprint(d: Path) -> str:
    """Cheap identity of a local directory: its absolute path and every file's size and mtime."""
    h = hashlib.sha256(str(d.resolve()).encode())
    for p in sorted(d.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(d)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return "dir:" + h.hexdigest()


def _clean_config(config: dict, spec: ModelSpec, dtype: str, keep_quantization: bool = False) -> dict:
    drop = ("_name_or_path", "transformers_version") + (() if keep_quantization else ("quantization_config",))
    config = {k: v for k, v in config.items() if k not in drop}
    if spec.vision is None:   # a vision-language checkpoint keeps its own class (models.vision)
        config["architectures"] = [spec.architecture]
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    return config


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF's metadata once per from_pretrained (config, tokenizer, weights), and a large
    vocabulary makes each parse slow (docs/performance.md, "Importing a GGUF"). For the import's duration
    gguf.GGUFReader, which transformers imports at each call, hands out one reader per file; the reader is only
    read."""
    import gguf as gguf_py

    original, readers = gguf_py.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    setattr(gguf_py, "GGUFReader", reader)   # a function standing in for the class, for transformers' one call
    try:
        yield
    finally:
        setattr(gguf_py, "GGUFReader", original)


def import_gguf(gguf: Path, store: Store, name: str, source: dict) -> Artifact:
    """Dequantize a GGUF with transformers into a bf16 safetensors checkpoint."""
    with _one_gguf_parse():
        return _import_gguf(gguf, store, name, source)


def _import_gguf(gguf: Path, store: Store, name: str, source: dict) -> Artifact:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unknown or damaged GGUFs
        raise LlmqError(f"{gguf}: cannot read this GGUF ({str(e).splitlines()[0][:200]}); supported architectures: "
                        + ", ".join(SUPPORTED_ARCHITECTURES.values())) from None
    spec = ModelSpec.from_config(hf_config.to_dict())
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # no or unknown tokenizer.ggml.* metadata: transformers raises ValueError / KeyError
        raise LlmqError(f"{gguf}: cannot build its tokenizer ({(str(e).splitlines() or [''])[0][:200]}); llmq needs "
                        "a GGUF that carries its tokenizer (tokenizer.ggml.* metadata)") from None
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=hf_config,
                                                 dtype=torch.float32)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()
             if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    with store.create("model", name, config={"source": source, "architecture": spec.to_dict(), "dtype": "bfloat16"},
                      needs=sum(t.numel() for t in state.values()) * 2) as w:
        save_state_dict(state, w.dir)
        write_json(w.dir / "config.json", _clean_config(hf_config.to_dict(), spec, "bfloat16"))
        model.generation_config.save_pretrained(w.dir)
        tokenizer.save_pretrained(w.dir)
        w.metrics.update(parameters=sum(t.numel() for t in state.values()),
                         size_bytes=sum(p.stat().st_size for p in w.dir.glob("*.safetensors")))
    return w.artifact


def _check_quantized(d: Path, spec: ModelSpec) -> None:
    """check_tensors' counterpart for a quantized checkpoint: every linear is read through the one reader, which
    refuses codes, scales and groups that do not fit the quantization config (qformat.read_linear), at the shape
    config.json gives, and every KV-cache scale; one line naming the tensor or field."""
    from .reader import CheckpointReader

    def fits(lw, want: tuple[int, int]) -> None:
        if tuple(lw.shape) != tuple(want):
            raise LlmqError(f"{d}: tensor {lw.name} has shape {list(lw.shape)}, but config.json gives {list(want)}")

    ck = CheckpointReader(d)
    embed = ck.embedding()
    for lw in (embed, ck.lm_head(embed)):
        fits(lw, (spec.vocab_size, spec.hidden_size))
    for i in range(spec.num_layers):   # one layer held at a time
        for role, lw in ck.layer_linears(i).items():
            fits(lw, spec.linear_shape(role))
        ck.kv_scales(i)


def import_hf_dir(d: Path, store: Store, name: str, source: dict, allow_pickle: bool) -> Artifact:
    """Copy a Hugging Face directory's safetensors as they are; convert pickle weights only on opt-in."""
    config = read_config(d)
    spec = ModelSpec.from_config(config)
    st = safetensors_files(d)
    if not st and not pickle_files(d):
        raise LlmqError(f"{d}: no model weights (*.safetensors) found")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    quantized = "quantization_config" in config
    if quantized:   # kept with the weights it describes (ModelOpt's hf_quant_config.json folded in); refused here
        from . import bnbformat, qformat  # where llmq cannot read it, before anything is copied

        bnbformat.parse_config(config) or qformat.parse_quantization_config(config)
    if st:  # names, shapes and dtypes (quantized: codes, scales and groups too) against the config, before any write
        from .reader import LazyTensors

        try:
            lazy = LazyTensors(st)
        except Exception as e:  # corrupt or truncated header
            raise LlmqError(f"{d}: a *.safetensors file is not readable ({e})") from None
        if quantized:
            _check_quantized(d, spec)
        else:
            check_tensors(spec, {n: lazy.info(n) for n in lazy}, str(d))
        if spec.vision is not None:
            from . import vision

            vision.check_tensors(lazy.vision_info(), str(d))
            if vision.runs_images(spec.vision):   # a family whose towers are carried, not run, needs no processor
                vision.load_processor(d)
    with store.create("model", name, config={"source": source, "architecture": spec.to_dict(), "dtype": dtype},
                      needs=sum(f.stat().st_size for f in st)) as w:
        if st:
            from safetensors import safe_open

            for f in st:
                try:
                    with safe_open(str(f), "pt"):
                        pass
                except Exception as e:  # corrupt or truncated header
                    raise LlmqError(f"{f}: not a readable safetensors file ({e})") from None
            for f in st:
                shutil.copyfile(f, w.dir / f.name)
            if (d / INDEX_NAME).is_file():
                shutil.copyfile(d / INDEX_NAME, w.dir / INDEX_NAME)
        else:
            save_state_dict(load_state_dict(d, allow_pickle=allow_pickle), w.dir)
        write_json(w.dir / "config.json", _clean_config(config, spec, dtype, keep_quantization=True))
        if (d / "generation_config.json").is_file():
            shutil.copyfile(d / "generation_config.json", w.dir / "generation_config.json")
        copy_tokenizer(d, w.dir)
        w.metrics.update(parameters=spec.num_parameters(),
                         size_bytes=sum(p.stat().st_size for p in w.dir.glob("*.safetensors")))
    return w.artifact


def _download_hub(repo_id: str) -> tuple[Path, str]:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                          "*.txt", "*.jinja"])
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise LlmqError(f"cannot download {repo_id!r} from the Hugging Face Hub ({reason}); without a network pass a "
                        "local model directory or .gguf file, or omit the model to use the embedded default") from None
    return Path(path), Path(path).name


def resolve_model(ref: str | None, store: Store, allow_pickle: bool = False) -> Artifact:
    """The `model` artifact for a model reference, importing it into the store on first use."""
    if ref in (None, "", "default") or ref in PACKAGED:
        model = PACKAGED.get(ref, DEFAULT)
        if (hit := _find_imported(store, model.fingerprint)) is not None:
            return hit
        gguf = packaged_gguf(model)
        source = {"type": "default" if model is DEFAULT else "packaged", "package": model.wheels[0].package,
                  "package_version": model.wheels[0].version,
                  "wheels": {w.filename: w.sha256 for w in model.wheels}, "gguf": model.gguf_name,
                  "gguf_sha256": model.gguf_sha256, "gguf_quantization": model.quantization, "upstream": model.hf_id,
                  "fingerprint": model.fingerprint} | ({"license": model.license} if model.license else {})
        return import_gguf(gguf, store, model.name, source)
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise LlmqError(f"{path}: not a model: expected a .gguf file or a Hugging Face model directory")
        from ..artifacts import sha256_file

        digest = sha256_file(path)
        fp = f"gguf:{digest}"
        if (hit := _find_imported(store, fp)) is not None:
            return hit
        source = {"type": "gguf", "path": str(path.resolve()), "gguf_sha256": digest, "fingerprint": fp}
        return import_gguf(path, store, _slug(path.stem), source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LlmqError(f"{path}: not a Hugging Face model directory (no config.json)")
        fp = _dir_fingerprint(path)
        if (hit := _find_imported(store, fp)) is not None:
            return hit
        source = {"type": "hf-dir", "path": str(path.resolve()), "fingerprint": fp}
        return import_hf_dir(path, store, _slug(path.name), source, allow_pickle)
    if _HUB_ID.match(ref) and not ref.startswith((".", "/", "~")):
        snap, revision = _download_hub(ref)
        fp = f"hub:{ref}@{revision}"
        if (hit := _find_imported(store, fp)) is not None:
            return hit
        source = {"type": "hub", "repo_id": ref, "revision": revision, "fingerprint": fp}
        return import_hf_dir(snap, store, _slug(ref.replace("/", "--")), source, allow_pickle)
    raise LlmqError(f"model {ref!r} not found: not a file, directory, artifact in the store, or hub id (org/name)")


def source_artifact(ref: str | None, store: Store, allow_pickle: bool = False) -> Artifact:
    """An existing artifact (path, name, name/vN, id) or, failing that, a model reference resolved into the store."""
    if ref not in (None, "", "default"):
        try:
            return store.resolve(ref)
        except ArtifactNotFound:
            pass
    return resolve_model(ref, store, allow_pickle=allow_pickle)
