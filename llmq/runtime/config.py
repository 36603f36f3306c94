"""The runtime's settings: one EngineConfig read by the engine, its worker and a draft model's worker."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import SPECULATIVE_MAX_BATCH

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_KV_CACHE_FRACTION = 0.25


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's (or engine's) max positions, capped at 4096
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache (per rank); None: kv_cache_fraction of free memory
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    kv_cache_dtype: str = "auto"  # "auto" (compute dtype, or the checkpoint's calibrated scheme) | "int8" | "fp8"
    enable_prefix_caching: bool = True
    tp: int = 1
    device: str | None = None
    dtype: str | None = None  # compute dtype; None: float32 on CPU, the checkpoint's 16-bit dtype on GPU
    compile: bool = False  # torch.compile the decode-only steps (runtime/compiled.py); tp 1 only
    # INT4 / INT8 weight-only products with activations rounded to int8 per block of 32 inputs (llama.cpp's Q8_0
    # arithmetic) on CPUs with AVX512-VNNI: ~2x faster decode, not what the quantize probe and the exports compute
    int8_activations: bool = False
    speculative: str | None = None  # "ngram" (prompt lookup) or a draft model's directory (same tokenizer); None: off
    num_speculative_tokens: int = 4  # draft tokens per speculating sequence and step
    speculative_max_batch: int | None = SPECULATIVE_MAX_BATCH  # no drafts while more sequences run (None: any)
