"""Reading and writing Hugging Face checkpoint directories as safetensors; pickle only on explicit opt-in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import LlmqError
from .vision import PROCESSOR_FILES

SHARD_BYTES = 4 << 30
INDEX_NAME = "model.safetensors.index.json"
# the tokenizer's files and, for a vision-language model, its processor's (how an image becomes input)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   *PROCESSOR_FILES)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def safetensors_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def pickle_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


class ShardedWriter:
    """A checkpoint's tensors written as they come, a tensor at a time (see `safetensors_io`): shards of at most
    `shard_bytes`, named as transformers names them (`model.safetensors` when one is enough, else
    `model-0000i-of-0000N.safetensors` with an index), so memory never holds more than the tensor being added."""

    def __init__(self, out_dir: Path, shard_bytes: int = SHARD_BYTES, rename=None):
        """rename: a tensor's name -> the name it is written under (a vision-language checkpoint's layout:
        reader.LazyTensors.stored_name)."""
        self.out_dir, self.shard_bytes, self.rename = Path(out_dir), shard_bytes, rename
        self._done: list[tuple[Path, list[str]]] = []
        self._current = None  # the SafetensorsWriter of the shard being written
        self._names: list[str] = []
        self.total = 0

    def add(self, name: str, tensor) -> None:
        name = self.rename(name) if self.rename is not None else name
        nbytes = tensor.numel() * tensor.element_size()
        if self._current is not None and self._current.nbytes and self._current.nbytes + nbytes > self.shard_bytes:
            self._finish_shard()
        if self._current is None:
            from .safetensors_io import SafetensorsWriter

            self._current = SafetensorsWriter(self.out_dir / f".shard-{len(self._done) + 1}.safetensors")
        self._current.add(name, tensor)
        self._names.append(name)
        self.total += nbytes

    def _finish_shard(self) -> None:
        self._current.close()
        self._done.append((self._current.path, self._names))
        self._current, self._names = None, []

    def close(self) -> list[str]:
        """Finish the last shard, give the shards their final names, write the index; returns the file names."""
        if self._current is not None:
            self._finish_shard()
        if len(self._done) <= 1:
            if not self._done:
                from .safetensors_io import SafetensorsWriter

                SafetensorsWriter(self.out_dir / "model.safetensors").close()
            else:
                self._done[0][0].rename(self.out_dir / "model.safetensors")
            return ["model.safetensors"]
        files, weight_map = [], {}
        for i, (path, names) in enumerate(self._done, 1):
            fname = f"model-{i:05d}-of-{len(self._done):05d}.safetensors"
            path.rename(self.out_dir / fname)
            files.append(fname)
            weight_map.update({n: fname for n in names})
        (self.out_dir / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2, sort_keys=True))
        return files + [INDEX_NAME]

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
        for path, _ in self._done:
            path.unlink(missing_ok=True)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self.abort()


def save_state_dict(state: dict, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write tensors as safetensors, sharded with an HF index when larger than `shard_bytes`. Deterministic order."""
    with ShardedWriter(out_dir, shard_bytes) as w:
        for n in sorted(state):
            w.add(n, state[n])
        return w.close()


def load_state_dict(d: Path, allow_pickle: bool = False) -> dict:
    """All tensors of a checkpoint directory. Pickle files are refused unless the user opted in."""
    from safetensors.torch import load_file

    st = safetensors_files(d)
    if st:
        state = {}
        for f in st:
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
                raise LlmqError(f"{f}: not a readable safetensors file ({e})") from None
        return state
    pk = [p for p in pickle_files(d) if "training_args" not in p.name and "optimizer" not in p.name]
    if not pk:
        raise LlmqError(f"{d}: no *.safetensors weights found")
    if not allow_pickle:
        raise LlmqError(f"{d} has only pickle weights ({pk[0].name}); pickle can run arbitrary code, "
                        "import it with `llmq import PATH --allow-pickle` if you trust this checkpoint")
    import torch

    state = {}
    for f in pk:
        try:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # UnpicklingError for a forbidden global, RuntimeError/EOFError for a damaged file, ...
            raise LlmqError(f"{f}: refused, not a plain tensor checkpoint ({_pickle_reason(e)}); nothing in it was "
                            "run; convert it to safetensors only if you trust its source") from None
    return state


def _pickle_reason(e: Exception) -> str:
    """The one line of torch's many-line weights_only refusal that says what the pickle asked for."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else type(e).__name__)
    return why.rstrip(".")


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if not copied:
        raise LlmqError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    return copied


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


HF_QUANT_CONFIG = "hf_quant_config.json"   # a ModelOpt checkpoint's quantization (TensorRT-LLM reads it first)
MIXED_QUANT_CONFIG = "quant_cfg.json"      # its per-layer algorithms when quant_algo is MIXED_PRECISION


def _json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LlmqError(f"{p}: not valid JSON ({e})") from None


def read_config(d: Path) -> dict:
    """config.json; in a ModelOpt checkpoint `hf_quant_config.json` (and `quant_cfg.json`) become its
    quantization_config, quant_method "modelopt", as TensorRT-LLM reads them: the file over config.json's copy."""
    p = Path(d) / "config.json"
    try:
        cfg = _json(p)
    except FileNotFoundError:
        raise LlmqError(f"{d}: no config.json (not a Hugging Face model directory)") from None
    if (Path(d) / HF_QUANT_CONFIG).is_file():
        mixed = Path(d) / MIXED_QUANT_CONFIG
        cfg["quantization_config"] = {"quant_method": "modelopt", **_json(Path(d) / HF_QUANT_CONFIG),
                                      **({MIXED_QUANT_CONFIG: _json(mixed)} if mixed.is_file() else {})}
    return cfg
