"""What the FP4 methods (nvfp4.py, mxfp4.py) share: round-to-nearest onto the E2M1 grid in the format's blocks,
weight-only (W4A16) or, with --w4a4, with activations rounded to the same format at run time (compressed-tensors'
NVFP4 / MXFP4 presets, llm-compressor's W4A4); with --gptq the weights are rounded by GPTQ onto the same grid
(gptq_fp4 below: calibrated, the same format). The arithmetic is `llmq.quant`'s; the block size is the format's, so
--group-size may only repeat it. --w4a4 is its own flag rather than a value of --activations: that option picks
dynamic or static 8-bit activation scales, while FP4 activations have both at once (NVFP4: dynamic block scales under
a static global scale), and only the FP4 methods have them."""

from __future__ import annotations

import dataclasses

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from ...options import default_of
from . import gptq


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
    if not opts.gptq and (opts.act_order or opts.damp != default_of(type(opts).__dataclass_fields__["damp"])):
        raise LlmqError(f"--act-order / --damp are GPTQ's; add --gptq to round {flag} with GPTQ")
    if opts.gptaq:
        raise LlmqError(f"--gptaq is integer GPTQ's (--method gptq); {flag} --gptq aims at each linear's own output")


def calibrated(opts) -> bool:
    """The methods' CALIBRATED (NVFP4's W4A4 adds its input global scale): GPTQ needs calibration inputs,
    round-to-nearest none."""
    return opts.gptq


def quantize_weight(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None, search: bool = False,
                    importance: torch.Tensor | None = None) -> qformat.QuantizedWeight:
    """Round-to-nearest FP4 QuantizedWeight of w [out, in] (weight-only); NVFP4 with `global_scale` when given (its
    unit's); `search`: each block's scale searched (search_scales), its error weighted per input column by
    `importance`."""
    if fmt == "nvfp4":
        codes, scale, g = quant.nvfp4_quantize(w.float(), global_scale)
    else:
        (codes, scale), g = quant.mxfp4_quantize(w.float()), None
    if search:
        codes, scale = search_scales(w, scale, g, importance)
    return qformat.QuantizedWeight(q=codes.cpu(), scale=scale.cpu(), zero_point=None, bits=4,
                                   group_size=qformat.FP4_FORMATS[fmt][0], symmetric=True,
                                   global_scale=g.cpu() if g is not None else None)


SEARCH_STEPS = 2  # --scales search: NVFP4's E4M3 scale codes this many either side of amax's; MXFP4's exponent +-1


def search_scales(w: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                  importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of w with each block's scale the candidate with the least squared rounding error, weighted
    per input column by `importance` where given: the neighbours of round-to-nearest's `scale` on the scale's own grid
    (E4M3 codes, or E8M0 exponents), which is among them, so the error never exceeds amax's. The codes are
    round-to-nearest's for the chosen scale (quant.e2m1_codes of the exact quotient); an all-zero block keeps 0."""
    n, k = w.shape
    block = k // scale.shape[-1]
    wb = w.double().reshape(n, -1, block)
    imp = torch.ones(k, dtype=torch.float64, device=w.device) if importance is None else importance.double()
    imp = imp.to(w.device).reshape(1, -1, block)
    e8m0 = scale.dtype == torch.uint8
    base = scale.to(w.device).view(torch.uint8).int()
    steps = 1 if e8m0 else SEARCH_STEPS
    best = best_err = best_codes = None
    for d in [0, *(d for i in range(1, steps + 1) for d in (-i, i))]:
        cand = torch.where(base > 0, (base + d).clamp(1, 254 if e8m0 else 126), base).to(torch.uint8)
        cand = cand if e8m0 else cand.view(quant.FP8)
        step = quant.fp4_block_scale(cand, global_scale).double().clamp_min(torch.finfo(torch.float64).tiny)
        codes = quant.e2m1_codes(wb / step.unsqueeze(-1))
        err = (imp * (quant.e2m1_values(codes).double() * step.unsqueeze(-1) - wb) ** 2).sum(-1)
        if best is None:
            best, best_err, best_codes = cand, err, codes
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
        best = torch.where(better, cand.view(torch.uint8), best.view(torch.uint8)).view(cand.dtype)
    return best_codes.reshape(n, k), best


def gptq_fp4(w: torch.Tensor, h: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None,
             damp: float = 0.01, act_order: bool = False, consume: bool = False,
             search: bool = False) -> qformat.QuantizedWeight:
    """GPTQ onto an FP4 grid ("nvfp4" / "mxfp4"): the block scales (and NVFP4's global scale, `global_scale` where
    the unit shares one) are round-to-nearest's, fixed from the weight before the sweep, as llm-compressor's
    GPTQModifier does for an FP4 scheme; each column is then rounded onto the E2M1 grid of its block's scale
    (`quant.e2m1_codes` of the exact quotient, as round-to-nearest rounds) with its error fed forward. The result is
    the format round-to-nearest writes, so every export and the runtime read it unchanged. `search`: the block
    scales searched (search_scales) with the error weighted by diag(H), as the integer search is."""
    W, H, importance = gptq.prepare(w, h, consume)
    rtn_weight = quantize_weight(W, fmt, global_scale, search, importance)
    step = quant.fp4_block_scale(rtn_weight.scale.to(W.device), None if rtn_weight.global_scale is None
                                 else rtn_weight.global_scale.to(W.device))
    block = rtn_weight.group_size
    tiny = torch.finfo(torch.float64).tiny

    def round_column(col, W1, j):
        s = step[:, col // block]
        codes = quant.e2m1_codes(W1[:, j].double() / s.double().clamp_min(tiny))
        return codes.float(), quant.e2m1_values(codes) * s

    Q = gptq.sweep(W, H, damp, act_order, gptq.BLOCK, round_column)
    return dataclasses.replace(rtn_weight, q=Q.to(torch.uint8).cpu())


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
    if ctx.opts.gptq:
        o = ctx.opts
        out = gptq.quantize_layer(ctx, lambda n, w, h, consume: gptq_fp4(w, h, fmt, shared.get(n), o.damp,
                                                                         o.act_order, consume, o.search))
    else:
        out = {n: quantize_weight(lin.weight.data, fmt, shared.get(n), ctx.opts.search)
               for n, lin in ctx.linears.items()}
    if not w4a4:
        return out
    return {n: dataclasses.replace(qw, dynamic=True, input_global_scale=inputs[n].cpu() if n in inputs else None)
            for n, qw in out.items()}
