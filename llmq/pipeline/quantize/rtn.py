"""Round-to-nearest: the baseline method and the grid parameters every other weight-only method reuses.

Two scale rules (`llmq quantize --scales`):
- amax: symmetric scale = max|w| / qmax, zero point 0, q = clamp(round(w / scale), qmin, qmax) with signed q in
  [-2^(b-1), 2^(b-1)-1] (so -2^(b-1) is never used); asymmetric: the grid spans [min(w, 0), max(w, 0)] with scale =
  (max - min) / (qmax - qmin) and an integer zero point z = clamp(round(qmin - min / scale)), q = clamp(round(w /
  scale) + z); real w = (q - z) * s. What compressed-tensors' observers and the GPTQ / AWQ papers' code compute.
- search (the default): each group's scale minimises its squared rounding error, optionally weighted per input
  column by calibration statistics (the mean squared input, what llama.cpp calls an importance matrix). Symmetric
  candidates map the group's signed extreme m to t in qmin x [0.9, 1.3] or qmax x [0.9, 1.3] (a scale m / t, which
  is negative when m and t differ in sign: that is how the extreme of either sign reaches the wider side of the grid,
  as llama.cpp's Q4_0 does with d = m / -8), each refitted by least squares on the integers it produced (llama.cpp's
  make_qx_quants); asymmetric candidates shrink each end of [min, max] by clip ratios 1.0 .. 0.7 (AWQ's clip search,
  per end). amax's grid is among the candidates, and neither the refit (at fixed integers) nor rounding to the
  refitted scale raises the error, so the search loses to amax only by how the stored scale rounds.
Scales are per output channel ([out, 1]), per group of `group_size` input columns ([out, in / g]) or per tensor ([1]).
They are rounded to the dtype they are stored in *before* the weights are rounded (amax: up, so the grid still spans
the range), so the stored integers are the nearest ones for the stored scale and what is stored is exactly what was
optimised. The rounding itself is `llmq.quant.round_int`, the grid the runtime dequantizes.
"""

from __future__ import annotations

from functools import partial

import torch

from ... import quant
from ...models import qformat

BITS = (4, 5, 8)   # 5: integers in [-16, 15], for GGUF's Q5_0 / Q5_1 (llmq's runtime and llama.cpp; vLLM runs 4 / 8)
CALIBRATED = False


def round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale as stored in `dtype`, back in float32: rounded *up* to the next value `dtype` holds (never zero), so
    the grid still spans the range it was computed for and rounding to it never clips more than half a step."""
    tiny = torch.finfo(dtype).tiny
    s = scale.float().clamp_min(tiny)
    if dtype == torch.float32:
        return s
    stored = s.to(dtype)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    bumped = (stored.view(bits) + 1).view(dtype)  # positive floats: the next bit pattern is the next larger value
    return torch.where(stored.float() < s, bumped, stored).float()


def grid_params(w: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype, search: bool = False,
                importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero) over the last dimension of w (keepdim), scale rounded to scale_dtype; zero None if symmetric.
    search: the error-minimising scale (module docstring), weighted by `importance` (broadcasting over w) if given."""
    qmin, qmax = quant.int_range(bits)
    w = w.float()
    if search:
        imp = torch.ones_like(w) if importance is None else importance.float().expand_as(w)
        return _searched_symmetric(w, imp, bits, scale_dtype) if symmetric else _searched_asymmetric(
            w, imp, bits, scale_dtype)
    if symmetric:
        return round_scale(w.abs().amax(-1, keepdim=True) / qmax, scale_dtype), None
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    hi = w.amax(-1, keepdim=True).clamp(min=0)
    scale = round_scale((hi - lo) / (qmax - qmin), scale_dtype)
    zero = (qmin - lo / scale).round().clamp(qmin, qmax)
    return scale, zero


RATIOS = tuple(i / 40 for i in range(-4, 13))    # symmetric: t = each end of the grid x (1 + -0.1 .. 0.3)
CLIPS = tuple(1 - i / 20 for i in range(7))      # asymmetric: each end of [min, max] shrunk by 1.0 .. 0.7


def stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A signed scale as `dtype` holds it (nearest), back in float32, never zero (an all-zero group's integers are
    0 whatever the scale)."""
    s = scale.to(dtype).float()
    tiny = torch.finfo(dtype).tiny
    return torch.where(s.abs() < tiny, torch.full_like(s, tiny), s)


def _searched_symmetric(w: torch.Tensor, imp: torch.Tensor, bits: int, scale_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, None]:
    qmin, qmax = quant.int_range(bits)
    m = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # the signed extreme
    m = torch.where(m == 0, torch.ones_like(m), m)
    best_s, best_err = m / qmax, torch.full_like(m, float("inf"))
    for t in [qmax] + [end * (1 + r) for end in (qmin, qmax) for r in RATIOS]:
        s = m / t
        q = quant.round_int(w, s, bits=bits)
        wq = imp * q
        sum_xq, sum_qq = (wq * w).sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True)
        fit = torch.where(sum_qq > 0, sum_xq / sum_qq.clamp_min(1e-30), s)
        # the error itself, not sum(imp * w^2) - sum_xq^2 / sum_qq: at 8 bits that difference of two near-equal
        # float32 sums is mostly rounding, and chose candidates worse than amax's
        err = (imp * (w - fit * q).pow(2)).sum(-1, keepdim=True)
        better = err < best_err
        best_s, best_err = torch.where(better, fit, best_s), torch.where(better, err, best_err)
    return stored_scale(best_s, scale_dtype), None


def _searched_asymmetric(w: torch.Tensor, imp: torch.Tensor, bits: int, scale_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    qmin, qmax = quant.int_range(bits)
    lo0, hi0 = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    best = None
    for a in CLIPS:
        for b in CLIPS:
            scale = round_scale((hi0 * b - lo0 * a) / (qmax - qmin), scale_dtype)
            zero = (qmin - lo0 * a / scale).round().clamp(qmin, qmax)
            err = (imp * (fake_quantize(w, scale, zero, bits) - w).pow(2)).sum(-1, keepdim=True)
            if best is None:
                best = (scale, zero, err)
            else:
                better = err < best[2]
                best = tuple(torch.where(better, x, y) for x, y in zip((scale, zero, err), best))
    return best[0], best[1]


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """w on the grid (scale, zero) and back to real values: what the quantized weight computes with."""
    q = quant.round_int(w.float(), scale, zero, bits)
    return (q - zero) * scale if zero is not None else q * scale


def group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] as [out, in / g, g] (g = in for per channel, group_size <= 0)."""
    n, k = w.shape
    g = k if group_size <= 0 else group_size
    return w.reshape(n, k // g, g)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype,
                    per_tensor: bool = False, search: bool = False, importance: torch.Tensor | None = None
                    ) -> qformat.QuantizedWeight:
    """Round-to-nearest QuantizedWeight of w [out, in]: per tensor, per channel (group_size <= 0) or per group.
    search / importance [in]: grid_params' scale search, weighted per input column."""
    w = w.float()
    n, k = w.shape
    if per_tensor:
        imp = None if importance is None else importance.reshape(1, -1).expand(n, k).reshape(1, -1)
        scale, zero = grid_params(w.reshape(1, -1), bits, symmetric, scale_dtype, search, imp)
        q = quant.round_int(w.reshape(1, -1), scale, zero, bits).reshape(n, k)
        scale, zero = scale.reshape(1), (zero.reshape(1) if zero is not None else None)
    else:
        wg = group_view(w, group_size)
        imp = None if importance is None else group_view(importance.reshape(1, k), group_size)
        scale, zero = grid_params(wg, bits, symmetric, scale_dtype, search, imp)
        q = quant.round_int(wg, scale, zero, bits).reshape(n, k)
        scale, zero = scale[..., 0], (zero[..., 0] if zero is not None else None)
    return pack(q, scale, zero, bits, group_size if (group_size > 0 and not per_tensor) else None, scale_dtype)


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int | None,
         scale_dtype: torch.dtype) -> qformat.QuantizedWeight:
    """A QuantizedWeight from float integer values and float32 scales already on the stored grid."""
    return qformat.QuantizedWeight(q=q.to(torch.int8).cpu(), scale=scale.to(scale_dtype).cpu(),
                                   zero_point=zero.to(torch.int8).cpu() if zero is not None else None, bits=bits,
                                   group_size=group_size, symmetric=zero is None)


def quantize_q4_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> qformat.Q4KWeight:
    """Round-to-nearest on GGML's Q4_K grid (`llmq.quant.q4_k_grid`: llama.cpp's sub-block search, 6-bit scales and
    mins), each weight then rounded to its sub-block's grid as quantize_row_q4_K_ref rounds it."""
    d, dmin, sc, m = quant.q4_k_grid(w.float(), importance)
    s, mn = quant.q4_k_scale_min(d, dmin, sc, m)
    return qformat.Q4KWeight(quant.q4_k_codes(w.float(), s, mn).cpu(), d.cpu(), dmin.cpu(), sc.cpu(), m.cpu())


# GGML's table grids by name: llmq.quant's search onto it, the weight it makes
IQ4_GRIDS = {"iq4_xs": (quant.iq4_xs_grid, qformat.IQ4XSWeight), "iq4_nl": (quant.iq4_nl_grid, qformat.IQ4NLWeight)}


def quantize_iq4(w: torch.Tensor, grid: str, importance: torch.Tensor | None = None) -> qformat.IQ4Weight:
    """Round-to-nearest on GGML's IQ4_XS or IQ4_NL grid (`grid`) as llama.cpp's quantize_iq4_xs / quantize_iq4_nl put
    a weight there (`llmq.quant.iq4_xs_grid` / `iq4_nl_grid`: the signed scale search per 32 weights, IQ4_XS's 6-bit
    scales under an fp16 d, codes on the table)."""
    search, cls = IQ4_GRIDS[grid]
    return cls(*(t.cpu() for t in search(w.float(), importance)))


GGML_RTN = {"q4_k": quantize_q4_k} | {g: partial(quantize_iq4, grid=g) for g in IQ4_GRIDS}   # by grid


def quantize_layer(ctx) -> dict[str, qformat.GGMLWeight | qformat.QuantizedWeight]:
    o = ctx.opts
    return {name: GGML_RTN[grid](lin.weight.data) if (grid := ctx.ggml_grid(name)) else
            quantize_weight(lin.weight.data, *ctx.grid(name), o.symmetric, ctx.scale_dtype, o.per_tensor,
                            search=o.search)
            for name, lin in ctx.linears.items()}
