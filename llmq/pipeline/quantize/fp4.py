"""What the FP4 methods (nvfp4.py, mxfp4.py) share: round-to-nearest onto the E2M1 grid in the format's blocks,
weight-only (W4A16), or with --gptq GPTQ onto the same grid (gptq.gptq_fp4: calibrated, the same format). The
arithmetic is `llmq.quant`'s; the block size is the format's, so --group-size may only repeat it."""

from __future__ import annotations

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat


def validate(opts, fmt: str) -> None:
    block = qformat.FP4_FORMATS[fmt][0]
    flag = f"--method {fmt}"
    if opts.group_size != block:
        raise LlmqError(f"{flag} has blocks of {block} input columns (the format's); drop --group-size "
                        f"{opts.group_size or 0}")
    if opts.per_tensor or not opts.symmetric:
        raise LlmqError(f"{flag} is symmetric with one scale per block of {block}: drop --per-tensor / --asym")
    if opts.activations != "dynamic":
        raise LlmqError(f"{flag} is weight-only (W4A16) in llmq so far: activations stay 16-bit; drop --activations")
    if not opts.gptq and (opts.act_order or opts.damp != 0.01):
        raise LlmqError(f"--act-order / --damp are GPTQ's; add --gptq to round {flag} with GPTQ")


def calibrated(opts) -> bool:
    """The methods' CALIBRATED: GPTQ needs calibration inputs, round-to-nearest none."""
    return opts.gptq


def quantize_weight(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> qformat.QuantizedWeight:
    """Round-to-nearest FP4 QuantizedWeight of w [out, in]; NVFP4 with `global_scale` when given (its unit's)."""
    if fmt == "nvfp4":
        codes, scale, g = quant.nvfp4_quantize(w.float(), global_scale)
    else:
        (codes, scale), g = quant.mxfp4_quantize(w.float()), None
    return qformat.QuantizedWeight(q=codes.cpu(), scale=scale.cpu(), zero_point=None, bits=4,
                                   group_size=qformat.FP4_FORMATS[fmt][0], symmetric=True,
                                   global_scale=g.cpu() if g is not None else None)


def quantize_layer(ctx, fmt: str) -> dict[str, qformat.QuantizedWeight]:
    """NVFP4: one global scale per unit (q/k/v, gate/up: the linears engines fuse into one matmul), from the unit's
    max |w|, as llm-compressor writes them: vLLM and TensorRT-LLM apply a single global scale to a fused matmul (the
    max of the parts', vLLM), so per-linear ones would be read with the wrong scale."""
    shared = {}
    if fmt == "nvfp4":
        for unit in ctx.spec.arch.unit_paths(ctx.spec.num_experts):
            names = [n for n in unit if n in ctx.linears]
            if names:
                g = quant.nvfp4_global_scale(torch.stack([ctx.linears[n].weight.abs().amax() for n in names]).max())
                shared |= dict.fromkeys(names, g)
    if ctx.opts.gptq:
        from . import gptq

        o = ctx.opts
        return gptq.quantize_layer(ctx, lambda n, w, h, consume: gptq.gptq_fp4(w, h, fmt, shared.get(n), o.damp,
                                                                               o.act_order, consume))
    return {n: quantize_weight(lin.weight.data, fmt, shared.get(n)) for n, lin in ctx.linears.items()}
