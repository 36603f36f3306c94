"""What the FP4 methods (nvfp4.py, mxfp4.py) share: round-to-nearest onto the E2M1 grid in the format's blocks,
weight-only (W4A16) or, with --w4a4, with activations rounded to the same format at run time (compressed-tensors'
NVFP4 / MXFP4 presets, llm-compressor's W4A4). The arithmetic is `llmq.quant`'s; the block size is the format's, so
--group-size may only repeat it. --w4a4 is its own flag rather than a value of --activations: that option picks
dynamic or static 8-bit activation scales, while FP4 activations have both at once (NVFP4: dynamic block scales under
a static global scale), and only the FP4 methods have them."""

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
        raise LlmqError(f"{flag} activations are 16-bit, or FP4 with --w4a4 (dynamic block scales"
                        f"{' under a calibrated global scale' if fmt == 'nvfp4' else ''}); drop --activations")


def quantize_weight(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None, w4a4: bool = False,
                    input_global_scale: torch.Tensor | None = None) -> qformat.QuantizedWeight:
    """Round-to-nearest FP4 QuantizedWeight of w [out, in]; NVFP4 with `global_scale` when given (its unit's); W4A4
    with FP4 activations (NVFP4: under `input_global_scale`)."""
    if fmt == "nvfp4":
        codes, scale, g = quant.nvfp4_quantize(w.float(), global_scale)
    else:
        (codes, scale), g = quant.mxfp4_quantize(w.float()), None
    return qformat.QuantizedWeight(q=codes.cpu(), scale=scale.cpu(), zero_point=None, bits=4,
                                   group_size=qformat.FP4_FORMATS[fmt][0], symmetric=True,
                                   global_scale=g.cpu() if g is not None else None, dynamic=w4a4,
                                   input_global_scale=input_global_scale.cpu() if input_global_scale is not None
                                   else None)


def quantize_layer(ctx, fmt: str) -> dict[str, qformat.QuantizedWeight]:
    """NVFP4: one global scale per unit (q/k/v, gate/up: the linears engines fuse into one matmul), from the unit's
    max |w|, as llm-compressor writes them: vLLM and TensorRT-LLM apply a single global scale to a fused matmul (the
    max of the parts', vLLM), so per-linear ones would be read with the wrong scale.
    NVFP4 W4A4: the input global scale likewise, 2688 / the largest calibration |x| of the unit (its linears read the
    same input; vLLM quantizes a fused layer's input with the max of its parts' input_global_scale, TensorRT-LLM
    asserts they are equal), the NVFP4 preset's static_minmax observer."""
    w4a4 = getattr(ctx.opts, "w4a4", False)
    shared, inputs = {}, {}
    if fmt == "nvfp4":
        absmax = ctx.input_absmax(list(ctx.linears)) if w4a4 else {}
        for unit in ctx.spec.arch.unit_paths(ctx.spec.num_experts):
            names = [n for n in unit if n in ctx.linears]
            if names:
                g = quant.nvfp4_global_scale(torch.stack([ctx.linears[n].weight.abs().amax() for n in names]).max())
                shared |= dict.fromkeys(names, g)
                if w4a4:
                    amax = torch.stack([absmax[n].max() for n in names]).max()
                    inputs |= dict.fromkeys(names, quant.nvfp4_global_scale(amax))
    return {n: quantize_weight(lin.weight.data, fmt, shared.get(n), w4a4, inputs.get(n))
            for n, lin in ctx.linears.items()}
