"""NVFP4 weights, round-to-nearest (W4A16): E2M1 values, an E4M3 scale per 16 inputs and an FP32 global scale per
tensor, written as compressed-tensors' "nvfp4-pack-quantized" (what vLLM, SGLang and TensorRT-LLM load on Blackwell;
llmq's runtime computes it on the dense path). The arithmetic and its conventions: `llmq.quant`."""

from __future__ import annotations

from ... import quant
from . import fp4

BITS = (4,)
CALIBRATED = fp4.calibrated  # --gptq
GROUP_SIZE = quant.NVFP4_BLOCK


def validate(opts, spec) -> None:
    fp4.validate(opts, "nvfp4")


def quantize_layer(ctx):
    return fp4.quantize_layer(ctx, "nvfp4")
