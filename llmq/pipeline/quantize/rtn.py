"""Round-to-nearest: the baseline method and the grid parameters every other weight-only method reuses.

Symmetric: scale = max|w| / qmax, zero point 0, q = clamp(round(w / scale), qmin, qmax) with signed q in
[-2^(b-1), 2^(b-1)-1]. Asymmetric: the grid spans [min(w, 0), max(w, 0)] with scale = (max - min) / (qmax - qmin)
and an integer zero point z = clamp(round(qmin - min / scale)), q = clamp(round(w / scale) + z); real w = (q - z) * s.
Scales are per output channel ([out, 1]), per group of `group_size` input columns ([out, in / g]) or per tensor ([1]).
They are rounded (up) to the dtype they are stored in *before* the weights are rounded, so the stored integers are
the nearest ones for the stored scale and what is stored is exactly what was optimised. The rounding itself is
`llmq.quant.round_int`, the grid the runtime dequantizes.
"""

from __future__ import annotations

import torch

from ... import quant
from ...models import qformat

BITS = (4, 8)
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


def grid_params(w: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero) over the last dimension of w (keepdim), scale rounded to scale_dtype; zero None if symmetric."""
    qmin, qmax = quant.int_range(bits)
    w = w.float()
    if symmetric:
        return round_scale(w.abs().amax(-1, keepdim=True) / qmax, scale_dtype), None
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    hi = w.amax(-1, keepdim=True).clamp(min=0)
    scale = round_scale((hi - lo) / (qmax - qmin), scale_dtype)
    zero = (qmin - lo / scale).round().clamp(qmin, qmax)
    return scale, zero


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
                    per_tensor: bool = False) -> qformat.QuantizedWeight:
    """Round-to-nearest QuantizedWeight of w [out, in]: per tensor, per channel (group_size <= 0) or per group."""
    w = w.float()
    n, k = w.shape
    if per_tensor:
        scale, zero = grid_params(w.reshape(1, -1), bits, symmetric, scale_dtype)
        q = quant.round_int(w.reshape(1, -1), scale, zero, bits).reshape(n, k)
        scale, zero = scale.reshape(1), (zero.reshape(1) if zero is not None else None)
    else:
        wg = group_view(w, group_size)
        scale, zero = grid_params(wg, bits, symmetric, scale_dtype)
        q = quant.round_int(wg, scale, zero, bits).reshape(n, k)
        scale, zero = scale[..., 0], (zero[..., 0] if zero is not None else None)
    return pack(q, scale, zero, bits, group_size if (group_size > 0 and not per_tensor) else None, scale_dtype)


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int | None,
         scale_dtype: torch.dtype) -> qformat.QuantizedWeight:
    """A QuantizedWeight from float integer values and float32 scales already on the stored grid."""
    return qformat.QuantizedWeight(q=q.to(torch.int8).cpu(), scale=scale.to(scale_dtype).cpu(),
                                   zero_point=zero.to(torch.int8).cpu() if zero is not None else None, bits=bits,
                                   group_size=group_size, symmetric=zero is None)


def quantize_layer(ctx) -> dict[str, qformat.QuantizedWeight]:
    o = ctx.opts
    return {name: quantize_weight(lin.weight.data, *ctx.grid(name), o.symmetric, ctx.scale_dtype, o.per_tensor)
            for name, lin in ctx.linears.items()}
