"""Loading a checkpoint directory (a model or quantized artifact) with transformers."""

from __future__ import annotations

from pathlib import Path


def pick_device(device: str | None = None) -> str:
    """The requested device, else CUDA when present, else CPU."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_hf_model(path: str | Path, dtype=None, device: str | None = None):
    """A transformers model in eval mode; fp32 by default because this is what CPUs compute fast."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..errors import LlmqError
    from . import qformat
    from .checkpoint import read_config

    qc = qformat.parse_quantization_config(read_config(Path(path)))
    if qc is not None and qformat.EMBEDDING in qc.modules:
        raise LlmqError(f"{path}: its embedding table is INT8 (`llmq quantize --embedding int8`), which "
                        "transformers cannot load (it needs a dense Embedding weight); run it with llmq's runtime "
                        "(--backend llmq)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    return model.to(pick_device(device)).eval()
