"""A quantized artifact's calibration statistics: each decoder linear's mean squared input per column, what
llama.cpp calls an importance matrix. `llmq quantize` keeps them (weight-only methods with calibration data) so that
the GGUF target can hand llama.cpp users llmq's calibration as an `--imatrix` file. They live beside the checkpoint,
under their own directory so that no checkpoint reader takes them for weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FILE = Path("calibration") / "importance.safetensors"


def write(artifact_dir: Path, importance: dict[str, torch.Tensor], source: str, tokens: int, windows: int,
          window: int) -> None:
    """Save {linear name: mean x^2 [in]} (float32) with the calibration source, token count and windows they were
    averaged over."""
    from safetensors.torch import save_file

    path = artifact_dir / FILE
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in sorted(importance.items())}, str(path),
              metadata={"source": source, "tokens": str(tokens), "windows": str(windows), "window": str(window)})


def read(artifact_dir: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(importance, {"source", "tokens", "windows", "window"}) of an artifact, or None when it has none."""
    from safetensors import safe_open

    path = artifact_dir / FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        meta = {k: v if k == "source" else int(v) for k, v in (f.metadata() or {}).items()}
        return {k: f.get_tensor(k) for k in f.keys()}, meta
