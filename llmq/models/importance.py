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
META = Path("calibration") / "importance.json"  # beside it, not in its header: safetensors orders metadata at random


def write(artifact_dir: Path, importance: dict[str, torch.Tensor], source: str, tokens: int, windows: int,
          window: int) -> None:
    """Save {linear name: mean x^2 [in]} (float32) with the calibration source, token count and windows they were
    averaged over."""
    import json

    from safetensors.torch import save_file

    path = artifact_dir / FILE
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in sorted(importance.items())}, str(path))
    (artifact_dir / META).write_text(json.dumps({"source": source, "tokens": tokens, "windows": windows,
                                                 "window": window}, sort_keys=True))


def read(artifact_dir: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(importance, {"source", "tokens", "windows", "window"}) of an artifact, or None when it has none."""
    import json

    from safetensors.torch import load_file

    path = artifact_dir / FILE
    if not path.is_file():
        return None
    return load_file(str(path)), json.loads((artifact_dir / META).read_text())
