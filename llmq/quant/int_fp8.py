"""The integer grid, the FP8 cast and the absmax scales (weights per channel or group, activations per token or
static, the KV cache).

The conventions are the compressed-tensors format's (what vLLM, SGLang and transformers load):
- integers: q = clamp(round_half_even(x / scale) + zero, qmin, qmax) on the signed grid [-2^(b-1), 2^(b-1) - 1];
  the real value is (q - zero) * scale;
- FP8 E4M3: x / scale saturated to +-448, then cast (round to nearest even);
- activations: per token (dynamic) with scale = max|x| / qmax, or one static per-tensor `input_scale`;
- KV cache: the same grids with the calibrated per-tensor or per-head k_scale / v_scale.
One place departs from compressed-tensors' reference forward (the transformers loader), on purpose: its dynamic int8
scale is max|x| / 127.5 (half its 255-wide range), while the engines that serve the format (vLLM's and SGLang's
per-token int8 kernels) use max|x| / 127; llmq follows the engines, since that is what a deployment computes.
Quotients and scales are float32 whatever the compute dtype, as those kernels compute them.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
EPS = 1e-8  # an all-zero row / head still gets a positive scale (its values quantize to 0 either way)


def int_range(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of the signed `bits`-bit grid."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def absmax_scale(amax: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Symmetric 8-bit scale that maps |x| <= amax onto the grid: amax / 127 (int8) or amax / 448 (fp8), float32.
    Per token, per tensor or per head is just which amax the caller reduces to."""
    return amax.float().clamp_min(EPS) / (FP8_MAX if fp8 else INT8_MAX)


def round_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, bits: int = 8) -> torch.Tensor:
    """x on the integer grid (integer values as floats): clamp(round(x / scale) + zero, qmin, qmax), with scale and
    zero broadcasting over x."""
    qmin, qmax = int_range(bits)
    q = torch.round(x / scale)
    if zero is not None:
        q = q + zero
    return q.clamp_(qmin, qmax)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to +-448 and rounded to float8_e4m3fn (the quotient in the dtype of x and scale)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero) * scale of a [N, K] weight whose scale / zero point is [1] (tensor), [N, 1] (channel) or
    [N, G] (G groups of K / G input columns); integer or FP8 q, computed in float32."""
    n, k = q.shape
    g = scale.shape[-1] if scale.dim() == 2 else 1
    w = q.float().reshape(n, g, k // g)
    if zero is not None:
        w = w - zero.float().reshape(-1, g, 1)
    return (w * scale.float().reshape(-1, g, 1)).reshape(n, k).to(dtype)


def quantize_tokens(x: torch.Tensor, input_scale: torch.Tensor | None, fp8: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] on the int8 grid (integer values as float32) or in float8, and their scale [M, 1]:
    per token when input_scale is None (dynamic), else the static per-tensor input_scale."""
    xf = x.float()
    if input_scale is None:
        s = absmax_scale(xf.abs().amax(-1, keepdim=True), fp8)
    else:
        s = input_scale.float().reshape(1, 1).expand(xf.shape[0], 1)
    return (to_fp8(xf, s) if fp8 else round_int(xf, s)), s


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] on the int8 grid per block of `block` inputs (integer values as float32) and the scales [M, K / block]
    (absmax / 127): the activations of the CPU low-bit kernels (runtime/layers/cpu_kernels), as llama.cpp's Q8_0."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    s = absmax_scale(xb.abs().amax(-1, keepdim=True), fp8=False)
    return round_int(xb, s).view(m, k), s.view(m, -1)


def encode_kv(x: torch.Tensor, scale: torch.Tensor, fp8: bool) -> torch.Tensor:
    """K or V on the cache's 8-bit grid (int8 or float8_e4m3fn) with a scale broadcasting over x."""
    xf = x.float()
    return to_fp8(xf, scale) if fp8 else round_int(xf, scale).to(torch.int8)


def decode_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The real values of an encode_kv result, in `dtype`."""
    return (q.float() * scale).to(dtype)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 [out, in] (out even) -> int8 [out/2, in]: row 2j in the low nibble, row 2j+1 in the high nibble
    (TensorRT-LLM's / ModelOpt's INT4 weight layout)."""
    lo, hi = q[0::2].to(torch.int16) & 0xF, q[1::2].to(torch.int16) & 0xF
    return (lo | (hi << 4)).to(torch.uint8).view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_rows: int8 [out/2, in] -> signed int4 values, int8 [out, in]."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)
