"""MXFP4 weights, round-to-nearest: E2M1 values and an E8M0 (power-of-two) scale per 32 inputs, the OCP MX format
GPT-OSS ships in, written as compressed-tensors' "mxfp4-pack-quantized". W4A16, or with --w4a4 activations too
(compressed-tensors' MXFP4 preset): E8M0 scales per 32 inputs at run time, nothing calibrated. The arithmetic and its
conventions: `llmq.quant`."""

from __future__ import annotations

from ... import quant
from . import fp4

BITS = (4,)
CALIBRATED = fp4.calibrated  # --gptq
GROUP_SIZE = quant.MXFP4_BLOCK


def validate(opts, spec) -> None:
    fp4.validate(opts, "mxfp4")


def quantize_layer(ctx):
    return fp4.quantize_layer(ctx, "mxfp4")
