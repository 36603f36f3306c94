"""FP8 E4M3 weights and activations ("float-quantized" in compressed-tensors).

E4M3 keeps 3 mantissa bits over a wide exponent range, so a linear needs no calibration search: the weight scale
maps its largest magnitude onto the format's largest finite value (448) per tensor or per output channel, and
values are rounded to the nearest representable float8. Activations are quantized per token at run time
(dynamic) or with one static per-tensor scale, max|X| / 448 from calibration, which is what FP8 GEMMs with a fixed
input scale (vLLM, TensorRT-LLM) consume. The runtime's FP8Linear runs torch._scaled_mm on GPUs with FP8 tensor
cores and reproduces the same rounding elsewhere.
`--group-size 128` is block FP8 (compressed-tensors' FP8_BLOCK, how DeepSeek-V3 and the Qwen3 FP8 releases ship): a
scale per 128 x 128 weight block and activations scaled per token per 128 inputs at run time (runtime/layers/fp8_block).
Input widths 128 does not divide get a partial last block, as compressed-tensors and vLLM allow.
"""

from __future__ import annotations

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from . import rtn, smoothquant

BITS = (8,)
CALIBRATED = lambda opts: opts.activations == "static"  # noqa: E731  (dynamic scales need no calibration pass)
WEIGHT_STRATEGIES = ("tensor", "channel")
PARTIAL_GROUPS = True  # a block FP8 --group-size need not divide the input widths: the last block is partial


def quantize_weight_fp8(w: torch.Tensor, strategy: str = "channel", input_absmax: torch.Tensor | None = None,
                        scale_dtype: torch.dtype = torch.float32) -> qformat.QuantizedWeight:
    """FP8 weight with scale max|W| / 448 per tensor ([1]) or per output channel ([N, 1]), rounded to its stored
    dtype first; activations dynamic per token, or static per tensor (max|X| / 448) from `input_absmax`."""
    if strategy not in WEIGHT_STRATEGIES:
        raise LlmqError(f"FP8 weight scales are per {' or per '.join(WEIGHT_STRATEGIES)}, not {strategy!r}")
    wf = w.float()
    amax = wf.abs().amax().reshape(1) if strategy == "tensor" else wf.abs().amax(1, keepdim=True)
    scale = rtn.round_scale(quant.absmax_scale(amax, fp8=True), scale_dtype)
    input_scale = None
    if input_absmax is not None:
        input_scale = quant.absmax_scale(input_absmax.max().reshape(1), fp8=True)
    q = quant.to_fp8(wf.double(), scale.double())  # one rounding, from the exact quotient
    return qformat.QuantizedWeight(q=q.cpu(), scale=scale.to(scale_dtype).cpu(), zero_point=None, bits=8,
                                   group_size=None, symmetric=True,
                                   input_scale=input_scale.cpu() if input_scale is not None else None,
                                   dynamic=input_absmax is None)


def quantize_weight_fp8_block(w: torch.Tensor) -> qformat.QuantizedWeight:
    """Block FP8 weight: a float32 scale per 128 x 128 block (`llmq.quant.fp8_block_quantize`), activations dynamic
    per token per group of 128."""
    block = (quant.FP8_BLOCK, quant.FP8_BLOCK)
    q, scale = quant.fp8_block_quantize(w.float(), block)
    return qformat.QuantizedWeight(q=q.cpu(), scale=scale.cpu(), zero_point=None, bits=8, group_size=None,
                                   symmetric=True, dynamic=True, block=block)


def validate(opts, spec) -> None:
    if not opts.group_size:
        return smoothquant.check_per_channel(opts, "fp8")
    if opts.group_size != quant.FP8_BLOCK or opts.activations != "dynamic" or not opts.symmetric:
        raise LlmqError(f"--method fp8 --group-size is block FP8: symmetric 128 x 128 weight blocks with dynamic "
                        f"per-token-group activations; use --group-size {quant.FP8_BLOCK} without --activations "
                        "static / --asym")


def quantize_layer(ctx) -> dict[str, qformat.QuantizedWeight]:
    if ctx.opts.group_size:
        return {n: quantize_weight_fp8_block(lin.weight.data) for n, lin in ctx.linears.items()}
    absmax = ctx.input_absmax(list(ctx.linears)) if ctx.opts.activations == "static" else {}
    strategy = "tensor" if ctx.opts.per_tensor else "channel"
    return {n: quantize_weight_fp8(lin.weight.data, strategy, absmax.get(n), ctx.scale_dtype)
            for n, lin in ctx.linears.items()}

