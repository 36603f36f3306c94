"""Reading and writing Hugging Face checkpoint directories as safetensors; pickle only on explicit opt-in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import LlmqError

SHARD_BYTES = 4 << 30
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def safetensors_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def pickle_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def save_state_dict(state: dict, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write tensors as safetensors, sharded with an HF index when larger than `shard_bytes`. Deterministic order."""
    from safetensors.torch import save_file

    names = sorted(state)
    shards: list[dict] = [{}]
    size = 0
    for n in names:
        t = state[n].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True))
    return files + [INDEX_NAME]


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
                        "pass --allow-pickle if you trust this checkpoint")
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


def read_config(d: Path) -> dict:
    p = Path(d) / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise LlmqError(f"{d}: no config.json (not a Hugging Face model directory)") from None
    except json.JSONDecodeError as e:
        raise LlmqError(f"{p}: not valid JSON ({e})") from None
