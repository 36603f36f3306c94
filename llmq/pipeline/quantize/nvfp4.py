"""NVFP4 weights, round-to-nearest: E2M1 values, an E4M3 scale per 16 inputs and an FP32 global scale per tensor,
written as compressed-tensors' "nvfp4-pack-quantized" (what vLLM, SGLang and TensorRT-LLM load on Blackwell; llmq's
runtime computes it on the dense path). W4A16, or with --w4a4 activations too (compressed-tensors' NVFP4 preset): E4M3
scales per 16 inputs at run time under a calibrated FP32 input global scale. The arithmetic and its conventions:
`llmq.quant`."""

from __future__ import annotations

from ... import quant
from . import fp4

BITS = (4,)
CALIBRATED = lambda opts: opts.w4a4 or fp4.calibrated(opts)  # noqa: E731  (W4A4: the input global scale; --gptq)
GROUP_SIZE = quant.NVFP4_BLOCK


def validate(opts, spec) -> None:
    fp4.validate(opts, "nvfp4")


def quantize_layer(ctx):
    return fp4.quantize_layer(ctx, "nvfp4")
