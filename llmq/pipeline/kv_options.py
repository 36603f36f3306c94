"""What `llmq quantize-kv` (or a recipe's quantize-kv stage) asks for. Apart from the stage (kvcache.py), which needs
torch, so that the command line can read it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import Options, option
from ..runtime.config import KV_QUANTIZED

GRANULARITIES = ("auto", "tensor", "head")


@dataclass(frozen=True)
class KVOptions(Options):
    kv: str = option(help="KV-cache element type.", choices=KV_QUANTIZED, aliases=("kv_cache_dtype",))
    granularity: str = option("auto", "auto: per head only where it cuts the held-out reconstruction error by >= 10%; "
                              "head: one scale per KV head and layer; tensor: one per layer for K and for V.",
                              choices=GRANULARITIES,
                              switches={"--auto": "auto", "--per-head": "head", "--per-tensor": "tensor"})
    calib: str | None = option(None, "Calibration text: a .txt/.jsonl file, a directory, or a dataset name "
                               "(default: the bundled offline text).", metavar="DATA")
    num_samples: int = option(16, "Calibration sequences.", ge=1, aliases=("calib_samples",))
    seq_len: int = option(512, "Tokens per calibration sequence.", ge=2)
    image_share: float | None = option(None, "Share of the calibration samples that are generated image + question "
                                       "conversations (vision-language models; default 0.25 there; 0: text only).",
                                       ge=0, lt=1)
    probe_tokens: int = option(2048, "Held-out tokens for the error and KLD measurement.", ge=2,
                               aliases=("heldout_tokens",))
    margin: float = option(0.1, internal=True, ge=0, lt=1)  # auto: per head must cut the held-out error this much
    name: str | None = option(None, "Artifact name (default: <source>-kv<int8|fp8>).")
    device: str | None = option(None, "Device for calibration (default: cuda when present, else cpu).")
