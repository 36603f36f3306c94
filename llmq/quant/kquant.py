"""GGML's Q4_K ("k-quant" 4-bit), llama.cpp's ggml-common.h block_q4_K / ggml-quants.c: a row is cut into super-blocks
of 256 weights, each 8 sub-blocks of 32. Weight = d * sc * n - dmin * m, n in [0, 15] (a nibble), sc and m 6-bit
integers [0, 63] per sub-block, d and dmin fp16 per super-block. A super-block is 144 bytes: d, dmin (fp16, little
endian), 12 bytes of packed sc / m (bytes 0-3: sc[0..3] in the low 6 bits, bytes 4-7: m[0..3]; bytes 8-11: the low
nibbles of sc[4..7] and, high nibble, of m[4..7]; the top 2 bits of sc[4..7] / m[4..7] in the top 2 bits of bytes
0-3 / 4-7), then 128 bytes of nibbles: each 64 weights are 32 bytes, weight l in the low nibble of byte l and
weight 32 + l in the high one. Dequantization (dequantize_row_q4_K, gguf-py's Q4_K): s = d * sc and mn = dmin * m in
float32 (both exact: 11 x 6 significant bits), then s * n (exact: at most 21 bits) - mn, rounded once to float32.
"""

from __future__ import annotations

import torch

Q4K_SUPER, Q4K_SUB = 256, 32
Q4K_BYTES = 144
Q4K_STEPS = 20  # make_qkx2_quants' candidate scales: iscale = (15 - 1 + 0.1 * i) / (max - min), i = 0..20


def _q4k_sub_blocks(w: torch.Tensor, importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-weight sub-block of w [B, 32] the (scale >= 0, min >= 0) of the asymmetric 15-step grid w ~ scale * n -
    min with the least weighted squared error, searched as llama.cpp's make_qkx2_quants (rmin -1, rdelta 0.1, 20
    steps, squared error): the range [min(w, 0), max w] split into 15 .. 17 steps, each candidate's integers refitted
    by weighted least squares of (scale, offset) (offset clamped to <= 0, as the format stores a non-negative min).
    Weights per value: llama.cpp's reference av_x + |w| (av_x = the sub-block's rms), times `importance` [B, 32] where
    given (a calibration statistic, llmq's --scales search weighting)."""
    x = w.float()
    weights = x.pow(2).mean(-1, keepdim=True).sqrt() + x.abs()
    if importance is not None:
        weights = weights * importance.float()
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True)
    span = hi - lo
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    sum_w, sum_x = weights.sum(-1, keepdim=True), (weights * x).sum(-1, keepdim=True)

    def codes(iscale):
        return torch.round(iscale * (x - lo)).clamp_(0, 15)

    def error(scale, offset, n):
        return (weights * (scale * n + offset - x).pow(2)).sum(-1, keepdim=True)

    best_scale, best_off = span / 15, lo
    best_err = error(best_scale, best_off, codes(15 / span))
    for i in range(Q4K_STEPS + 1):
        n = codes((-1 + 0.1 * i + 15) / span)
        sum_l, sum_l2, sum_xl = (weights * n).sum(-1, keepdim=True), (weights * n * n).sum(-1, keepdim=True), \
            (weights * n * x).sum(-1, keepdim=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale, off = (sum_w * sum_xl - sum_x * sum_l) / safe, (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = off > 0
        scale = torch.where(pos, sum_xl / sum_l2.clamp_min(1e-30), scale)
        off = torch.where(pos, torch.zeros_like(off), off)
        err = error(scale, off, n)
        better = ok & (err < best_err)
        best_scale, best_off = torch.where(better, scale, best_scale), torch.where(better, off, best_off)
        best_err = torch.where(better, err, best_err)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale).clamp_min(0)
    return best_scale[..., 0], (-best_off)[..., 0].clamp_min(0)


def q4_k_grid(w: torch.Tensor, importance: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q4_K grid of w [N, K] (K a multiple of 256): (d float16 [N, K / 256], dmin float16 [N, K / 256], sc uint8
    [N, K / 32], m uint8 [N, K / 32]). Per sub-block the error-minimising (scale, min) (_q4k_sub_blocks), then, as
    quantize_row_q4_K_ref: sc = round(63 * scale / max scale) and m = round(63 * min / max min) over the super-block
    (at most 63), d = max scale / 63 and dmin = max min / 63 rounded to fp16. importance [K] (optional): a per-column
    weight of the search."""
    n, k = w.shape
    if k % Q4K_SUPER:
        raise ValueError(f"Q4_K needs rows of a multiple of {Q4K_SUPER} weights, not {k}")
    imp = None if importance is None else importance.float().reshape(1, k).expand(n, k).reshape(-1, Q4K_SUB)
    scale, mn = _q4k_sub_blocks(w.float().reshape(-1, Q4K_SUB), imp)
    scale, mn = scale.reshape(n, k // Q4K_SUPER, 8), mn.reshape(n, k // Q4K_SUPER, 8)
    max_s, max_m = scale.amax(-1, keepdim=True), mn.amax(-1, keepdim=True)
    inv_s = torch.where(max_s > 0, 63 / max_s.clamp_min(1e-30), torch.zeros_like(max_s))
    inv_m = torch.where(max_m > 0, 63 / max_m.clamp_min(1e-30), torch.zeros_like(max_m))
    sc = torch.round(inv_s * scale).clamp(0, 63).to(torch.uint8).reshape(n, -1)
    m = torch.round(inv_m * mn).clamp(0, 63).to(torch.uint8).reshape(n, -1)
    d, dmin = (max_s[..., 0] / 63).to(torch.float16), (max_m[..., 0] / 63).to(torch.float16)
    return d, dmin, sc, m


def q4_k_scale_min(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block the float32 step s = d * sc and offset mn = dmin * m [N, K / 32] (both exact)."""
    rep = lambda t: t.float().repeat_interleave(Q4K_SUPER // Q4K_SUB, dim=-1)  # noqa: E731
    return rep(d) * sc.float(), rep(dmin) * m.float()


def q4_k_codes(w: torch.Tensor, s: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or one column [N] with s, mn [N]) on the Q4_K grid of steps s and offsets mn ([N, K / 32] per
    sub-block, or matching w): n = clamp(round((w + mn) / s), 0, 15) in float32 (0 where s is 0), as
    quantize_row_q4_K_ref computes them; uint8."""
    x = w.float()
    if s.shape != x.shape:
        s, mn = (t.repeat_interleave(Q4K_SUB, dim=-1) for t in (s, mn))
    safe = torch.where(s > 0, s, torch.ones_like(s))
    n = torch.round((x + mn) / safe).clamp_(0, 15)
    return torch.where(s > 0, n, torch.zeros_like(n)).to(torch.uint8)


def dequantize_q4_k(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A Q4_K weight's real values s * n - mn per sub-block, in float32 (one rounding: the subtraction), then
    `dtype`: bit for bit llama.cpp's dequantize_row_q4_K and gguf-py's Q4_K."""
    n_rows, k = codes.shape
    s, mn = q4_k_scale_min(d, dmin, sc, m)
    v = codes.float().reshape(n_rows, -1, Q4K_SUB) * s.unsqueeze(-1) - mn.unsqueeze(-1)
    return v.reshape(n_rows, k).to(dtype)


def pack_q4_k(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
              ) -> torch.Tensor:
    """GGML block_q4_K bytes of a Q4_K weight: uint8 [N, K / 256, 144] (layout above)."""
    n_rows, k = codes.shape
    nb = k // Q4K_SUPER
    sc, m = sc.reshape(n_rows, nb, 8).to(torch.uint8), m.reshape(n_rows, nb, 8).to(torch.uint8)
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], m[..., :4], m[..., 4:]
    scales = torch.cat([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 15) | ((hi_m & 15) << 4)], -1)
    c = codes.to(torch.uint8).reshape(n_rows, nb, 4, 2, 32)
    qs = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n_rows, nb, 128)
    fp16 = lambda t: t.to(torch.float16).contiguous().view(torch.uint8).reshape(n_rows, nb, 2)  # noqa: E731
    return torch.cat([fp16(d), fp16(dmin), scales, qs], -1)


def unpack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4_k's inverse: uint8 [N, K / 256, 144] (or [N, K / 256 * 144]) -> (codes, d, dmin, sc, m)."""
    n_rows = blocks.shape[0]
    b = blocks.reshape(n_rows, -1, Q4K_BYTES)
    nb = b.shape[1]
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n_rows, nb)
    dmin = b[..., 2:4].contiguous().view(torch.float16).reshape(n_rows, nb)
    s03, m03, x = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat([s03 & 63, (x & 15) | ((s03 >> 6) << 4)], -1).reshape(n_rows, -1)
    m = torch.cat([m03 & 63, (x >> 4) | ((m03 >> 6) << 4)], -1).reshape(n_rows, -1)
    qs = b[..., 16:].reshape(n_rows, nb, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], -2).reshape(n_rows, nb * Q4K_SUPER)
    return codes, d, dmin, sc, m
