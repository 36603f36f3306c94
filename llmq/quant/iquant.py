"""GGML's 4-bit "i-quants" IQ4_XS and IQ4_NL, llama.cpp's ggml-common.h block_iq4_xs / block_iq4_nl and
ggml-quants.c: a weight is a step per 32 weights times v[n], n a nibble indexing the non-uniform table v
(kvalues_iq4nl, IQ4_VALUES). Both quantizers run one search (quantize_row_iq4_nl_impl): per 32 weights a signed scale
(_iq4_sub_block_scales); they differ in how the step is stored.

IQ4_XS (4.25 bits): a row is cut into super-blocks of 256 weights, each 8 sub-blocks of 32. Step = d * (ls - 32): ls a
6-bit integer per sub-block, d fp16 per super-block. A super-block is 136 bytes: d (fp16, little endian), scales_h
(uint16, little endian: bits 2i, 2i + 1 the top two bits of sub-block i's ls), scales_l (4 bytes: ls's low nibbles,
sub-block 2j in the low nibble of byte j, 2j + 1 in the high one), then 128 bytes of nibbles: per sub-block 16 bytes,
weight l in the low nibble of byte l and weight 16 + l in the high one.

IQ4_NL (4.5 bits): step = d, fp16 per block of 32 weights (llama.cpp writes it for IQ4_XS where 256 does not divide a
row). A block is 18 bytes: d (fp16, little endian), then 16 bytes of nibbles laid out as an IQ4_XS sub-block's.

Dequantization (dequantize_row_iq4_xs / _nl, gguf-py's IQ4_XS / IQ4_NL) is exact in float32: d * (ls - 32) * v has at
most 11 + 5 + 7 significant bits.
"""

from __future__ import annotations

import torch

IQ4_BLOCK = 32   # weights per step: an IQ4_XS sub-block, an IQ4_NL block
IQ4XS_SUPER = 256
IQ4XS_BYTES, IQ4NL_BYTES = 136, 18
IQ4_TRIES = 7   # quantize_iq4_xs' and quantize_iq4_nl's ntry: candidate inverse scales (itry - 127) / max, itry = -7..7
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=torch.float32)
_MIDPOINTS = (IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2   # exact: half-integers
GROUP_MAX_EPS = 1e-15   # a sub-block whose largest magnitude is below this gets scale 0, as in llama.cpp


def iq4_nearest(x: torch.Tensor) -> torch.Tensor:
    """The index (int64) of the IQ4 table value nearest each x (float32), by best_index_int8's rule: of the two values
    around x the lower one only where x is strictly closer to it, so a tie goes up; its end outside the table's range.
    That is the count of midpoints between neighbours at or below x: near a midpoint both float32 distances the C
    code compares are exact, so its comparison is x's with the midpoint."""
    return torch.bucketize(x, _MIDPOINTS.to(x.device), right=True)


def iq4_codes(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or one column [N] with step [N]) on the table of 32-weight steps `step` ([N, K / 32], or matching
    w): the nearest index of w * (1 / step) as llama.cpp rounds it (its reciprocal, then the product; index 8, the
    value 1, where the step is 0); uint8."""
    x = w.float()
    if step.shape != x.shape:
        step = step.repeat_interleave(IQ4_BLOCK, dim=-1)
    inv = torch.where(step != 0, step.reciprocal(), torch.zeros_like(step))
    return iq4_nearest(inv * x).to(torch.uint8)


def _iq4_sub_block_scales(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per 32-weight sub-block (a column of x [32, B], transposed so that each position is contiguous) the signed scale
    s of x ~ s * v[n] with the least weighted squared error, searched as quantize_row_iq4_nl_impl: the sub-block's
    largest-magnitude weight (signed, the first of equal ones) mapped onto +127 and, for 15 candidates, onto
    -(127 - i) (i = -7..7); each candidate's indices refitted to s = sum(w q x) / sum(w q^2), the best kept where it
    raises sum(w q x)^2 / sum(w q^2). The sums run in C's left-to-right float32 order: candidates can tie (a
    constant sub-block fits every one alike) and then the same one wins. [B], 0 where the sub-block is (nearly)
    zero."""
    v = IQ4_VALUES.to(x.device)
    peak = x.gather(0, x.abs().argmax(0, keepdim=True))
    live = peak.abs() >= GROUP_MAX_EPS
    peak = torch.where(live, peak, torch.ones_like(peak))

    def fit(inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = v[iq4_nearest(inv * x)]
        wq = weights * q
        terms = torch.stack([wq * x, wq * q], 1)   # [32, 2, B]
        sums = terms[0]
        for j in range(1, x.shape[0]):
            sums = sums + terms[j]
        return sums[:1], sums[1:]

    sum_qx, sum_q2 = fit((peak / 127).reciprocal())
    scale = torch.where(sum_q2 > 0, sum_qx / sum_q2, torch.zeros_like(sum_qx))
    best = scale * sum_qx
    for i in range(-IQ4_TRIES, IQ4_TRIES + 1):
        sum_qx, sum_q2 = fit(torch.full_like(peak, i - 127.0) / peak)   # one float32 division, as C's
        better = (sum_q2 > 0) & (sum_qx * sum_qx > best * sum_q2)
        scale = torch.where(better, sum_qx / sum_q2, scale)
        best = torch.where(better, scale * sum_qx, best)
    return torch.where(live, scale, torch.zeros_like(scale))[0]


def _iq4_scales(w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """_iq4_sub_block_scales of w [N, K] per 32 weights, [N, K / 32], each weight weighted by x^2 (times importance
    [K], a per-column calibration statistic, where given: llmq's --scales weighting, as q4_k_grid's; llama.cpp's
    imatrix path weights differently)."""
    n, k = w.shape
    if k % IQ4_BLOCK:
        raise ValueError(f"IQ4 grids need rows of a multiple of {IQ4_BLOCK} weights, not {k}")
    weights = w * w
    if importance is not None:
        weights = weights * importance.float().reshape(1, k)
    sub = lambda t: t.reshape(-1, IQ4_BLOCK).T.contiguous()  # noqa: E731
    return _iq4_sub_block_scales(sub(w), sub(weights)).reshape(n, -1)


def iq4_xs_grid(w: torch.Tensor, importance: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 256) on GGML's IQ4_XS grid as quantize_iq4_xs puts it there: (codes uint8 [N, K],
    d float16 [N, K / 256], ls uint8 [N, K / 32] in [0, 63]). Per sub-block the signed scale s of _iq4_scales, then
    per super-block d = -s_max / 32 (s_max the scale of largest magnitude), ls - 32 = clamp(round(s / d), -32, 31),
    and each sub-block's codes chosen again for its step d * (ls - 32), d unrounded as llama.cpp chooses them (the
    block stores d rounded to fp16)."""
    n, k = w.shape
    if k % IQ4XS_SUPER:
        raise ValueError(f"IQ4_XS needs rows of a multiple of {IQ4XS_SUPER} weights, not {k}")
    x = w.float()
    scale = _iq4_scales(x, importance).reshape(n, -1, IQ4XS_SUPER // IQ4_BLOCK)
    peak = scale.gather(-1, scale.abs().argmax(-1, keepdim=True))
    d = -torch.where(peak.abs() > 0, peak, torch.zeros_like(peak)) / 32
    inv = torch.where(d != 0, d.reciprocal(), torch.zeros_like(d))
    ls = torch.round(inv * scale).clamp_(-32, 31)
    codes = iq4_codes(x, (d * ls).reshape(n, -1))
    return codes, d[..., 0].to(torch.float16), (ls + 32).to(torch.uint8).reshape(n, -1)


def iq4_nl_grid(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) on GGML's IQ4_NL grid as quantize_iq4_nl puts it there: (codes uint8 [N, K],
    d float16 [N, K / 32]). Per block d is the signed scale of _iq4_scales rounded to fp16, the codes chosen on the
    unrounded scale as llama.cpp chooses them."""
    x = w.float()
    scale = _iq4_scales(x, importance)
    return iq4_codes(x, scale), scale.to(torch.float16)


def iq4_xs_steps(d: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """Per sub-block the float32 step d * (ls - 32) [N, K / 32] (exact)."""
    return d.float().repeat_interleave(IQ4XS_SUPER // IQ4_BLOCK, dim=-1) * (ls.float() - 32)


def dequantize_iq4(codes: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An IQ4_XS / IQ4_NL weight's real values step * v[code] in float32 (exact; steps float32 [N, K / 32]:
    iq4_xs_steps, IQ4_NL's d), then `dtype`: bit for bit llama.cpp's dequantize_row_iq4_xs / _nl and gguf-py's."""
    n_rows, k = codes.shape
    v = IQ4_VALUES.to(codes.device)[codes.long()].reshape(n_rows, -1, IQ4_BLOCK)
    return (v * steps.float().unsqueeze(-1)).reshape(n_rows, k).to(dtype)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> uint8 [N, K / 32, 16]: per 32 weights, weight l in the low nibble of byte l, 16 + l high."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return c[..., 0, :] | (c[..., 1, :] << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """_pack_nibbles' inverse: uint8 [N, ..., 16] -> codes [N, K]."""
    qs = qs.reshape(qs.shape[0], -1, 1, 16)
    return torch.cat([qs & 15, qs >> 4], -2).reshape(qs.shape[0], -1)


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    return d.to(torch.float16).contiguous().view(torch.uint8).reshape(*d.shape, 2)


def pack_iq4_xs(codes: torch.Tensor, d: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """GGML block_iq4_xs bytes of an IQ4_XS weight: uint8 [N, K / 256, 136] (layout above)."""
    n_rows, k = codes.shape
    nb = k // IQ4XS_SUPER
    ls = ls.reshape(n_rows, nb, 8).to(torch.int32)
    high = ((ls >> 4) << torch.arange(0, 16, 2, dtype=torch.int32, device=ls.device)).sum(-1, keepdim=True)
    scales_h = torch.cat([high & 255, high >> 8], -1).to(torch.uint8)
    low = (ls & 15).reshape(n_rows, nb, 4, 2)
    scales_l = (low[..., 0] | (low[..., 1] << 4)).to(torch.uint8)
    qs = _pack_nibbles(codes).reshape(n_rows, nb, 128)
    return torch.cat([_fp16_bytes(d.reshape(n_rows, nb)), scales_h, scales_l, qs], -1)


def unpack_iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_iq4_xs' inverse: uint8 [N, K / 256, 136] (or [N, K / 256 * 136]) -> (codes, d, ls)."""
    n_rows = blocks.shape[0]
    b = blocks.reshape(n_rows, -1, IQ4XS_BYTES)
    nb = b.shape[1]
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n_rows, nb)
    high = b[..., 2:3].to(torch.int32) | (b[..., 3:4].to(torch.int32) << 8)
    top = (high >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    low = torch.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], -1).reshape(n_rows, nb, 8)
    ls = (low.to(torch.int32) | (top << 4)).to(torch.uint8).reshape(n_rows, -1)
    return _unpack_nibbles(b[..., 8:]), d, ls


def pack_iq4_nl(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGML block_iq4_nl bytes of an IQ4_NL weight: uint8 [N, K / 32, 18] (layout above)."""
    return torch.cat([_fp16_bytes(d), _pack_nibbles(codes)], -1)


def unpack_iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_iq4_nl's inverse: uint8 [N, K / 32, 18] (or [N, K / 32 * 18]) -> (codes, d)."""
    n_rows = blocks.shape[0]
    b = blocks.reshape(n_rows, -1, IQ4NL_BYTES)
    return _unpack_nibbles(b[..., 2:]), b[..., 0:2].contiguous().view(torch.float16).reshape(n_rows, -1)
