"""FP4 weights (NVFP4 / MXFP4, "nvfp4-pack-quantized" / "mxfp4-pack-quantized" in compressed-tensors): E2M1 values
(0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code = sign bit 3 | magnitude index) in blocks along the input
dimension, each value rounded from the exact quotient, half to even on the grid (compressed-tensors' rounding),
saturating at 6. NVFP4: 16 values a block, an E4M3 block scale rounded (half to even) from block_amax * g / 6, and
one FP32 global scale g = 448 * 6 / amax per tensor that *divides*: real = q * (scale / g), with scale / g computed
in float32, as compressed-tensors' weight_global_scale does (ModelOpt's weight_scale_2 is its reciprocal, a
multiplier). MXFP4: 32 values a block, an E8M0 scale 2^(e - 127) with e - 127 = floor(log2 block_amax) - 2 (the OCP MX
rule: the block's largest magnitude lands in [4, 8), above 6 it saturates), no global scale. Other producers choose
differently where the choice leaves the meaning of stored numbers unchanged: llm-compressor's MX observer rounds a
block amax whose mantissa is >= 1.75 up to the next power of two before taking the exponent (fewer saturated values),
and gguf-py's NumPy MXFP4 quantizer breaks ties toward the smaller magnitude; every reader decodes the same exponent
and code alike, and llmq's exports carry its own. FP4 activations (W4A4) follow the serving kernels instead (see
`fp4_activations` below).
"""

from __future__ import annotations

import torch

from .int_fp8 import FP8, FP8_MAX

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of FP4 codes 0..7; code bit 3 is the sign
E2M1_MAX = 6.0
FP4_SIGN = 8
NVFP4_BLOCK, MXFP4_BLOCK = 16, 32
NVFP4_GLOBAL = FP8_MAX * E2M1_MAX  # 2688: the global scale maps the tensor's amax onto the largest E4M3 x E2M1 value
E8M0_BIAS = 127


def _nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the value of an ascending grid nearest to each x >= 0; a tie goes to the even index (an even
    last mantissa bit: round half to even); past the last value, the last (saturation)."""
    mids = ((grid[1:] + grid[:-1]) / 2).to(x.dtype)   # midpoints of these grids are exact in float32 and float64
    lo = torch.searchsorted(mids, x, right=False)
    hi = torch.searchsorted(mids, x, right=True)    # hi == lo + 1 exactly when x is a midpoint
    return torch.where(lo % 2 == 0, lo, hi)


def _e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite E4M3 values, ascending (bit patterns 0x00..0x7E)."""
    return torch.arange(127, dtype=torch.uint8).view(FP8).double()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 rounded once (half to even) to float8_e4m3fn, saturating at 448, from x's own precision (a float64
    x is not rounded to float32 on the way, as a cast would)."""
    return _nearest(x, _e4m3_grid().to(x.device)).to(torch.uint8).view(FP8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its block scale) as FP4 codes (uint8): the nearest E2M1 magnitude, half to even, saturating
    at 6, with the sign bit where x < 0 (a negative x that rounds to zero keeps its sign, as compressed-tensors
    packs it)."""
    grid = torch.tensor(E2M1, dtype=torch.float64, device=x.device)
    mag = _nearest(x.abs(), grid)
    return (mag | torch.where(x < 0, FP4_SIGN, 0)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of FP4 codes, float32."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes as [N, K / 2] bytes, two consecutive codes a byte, the first in the low nibble (compressed-tensors'
    weight_packed)."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_fp4: [N, K / 2] bytes as [N, K] codes."""
    return torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' weight_global_scale of a tensor with max |w| = amax: 2688 / amax in float32, [1]; 1 for an
    all-zero tensor (or one so small that the quotient overflows)."""
    g = NVFP4_GLOBAL / amax.float().reshape(1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(g, posinf=1.0)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // block, block)


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 round-to-nearest of w [N, K] (K a multiple of 16): (codes uint8 [N, K], E4M3 block scales [N, K / 16],
    global scale float32 [1]: `global_scale`, at most w's own, when tensors share one, else w's own). Every rounding
    is one rounding of the exact value (float64 holds the quotients)."""
    g = nvfp4_global_scale(w.float().abs().amax()) if global_scale is None else global_scale.float().reshape(1)
    wb = _blocks(w.double(), NVFP4_BLOCK)
    scale = round_e4m3(wb.abs().amax(-1) * g.double() / E2M1_MAX)
    step = fp4_block_scale(scale, g).double().clamp_min(torch.finfo(torch.float64).tiny)  # all-zero block: 0 / tiny
    return e2m1_codes(wb / step.unsqueeze(-1)).reshape(w.shape), scale, g


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 round-to-nearest of w [N, K] (K a multiple of 32): (codes uint8 [N, K], E8M0 biased exponents uint8
    [N, K / 32]). floor(log2 amax) is read off the exponent (frexp), never rounded through a logarithm."""
    wb = _blocks(w.double(), MXFP4_BLOCK)
    amax = wb.abs().amax(-1)
    exp = torch.frexp(amax).exponent - 1 - 2   # amax = m * 2^x, m in [0.5, 1): floor(log2 amax) = x - 1
    exp = torch.where(amax > 0, exp, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_codes(wb / torch.ldexp(torch.ones_like(amax), exp).unsqueeze(-1))   # exact: a power of two
    return codes.reshape(w.shape), (exp + E8M0_BIAS).to(torch.uint8)


def fp4_block_scale(scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 multiplier of each FP4 block: E4M3 scale / global scale (NVFP4, float32 division) or 2^(e - 127)
    (MXFP4's E8M0 uint8 exponents; exact)."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.int() - E8M0_BIAS)
    s = scale.float()
    return s / global_scale.float() if global_scale is not None else s


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP4 weight's real values: E2M1 value times its block's fp4_block_scale, computed in float32, then `dtype`."""
    n, k = codes.shape
    g = scale.shape[-1]
    v = e2m1_values(codes).reshape(n, g, k // g) * fp4_block_scale(scale, global_scale).unsqueeze(-1)
    return v.reshape(n, k).to(dtype)


# W4A4: FP4 activations, rounded at run time per block of the input dimension, as the engines that serve the formats
# compute them (vLLM / FlashInfer / TensorRT-LLM's `cvt_warp_fp16_to_fp4`, all float32, with the reciprocals that
# kernel approximates taken exactly here, as vLLM's own CPU reference `ref_nvfp4_quant` does):
# - NVFP4 (compressed-tensors' NVFP4 preset, llm-compressor's W4A4): per 16 inputs an E4M3 scale
#   s = e4m3(g * (amax * f32(1/6))) under a static per-tensor `input_global_scale` g = 2688 / calibrated amax (a
#   divisor, as the weight's); the quotient x * (1 / (s * (1 / g))), rounded half to even onto E2M1 and saturating at
#   6; real value code * s / g. An all-zero block has s = 0 and codes 0.
# - MXFP4 (compressed-tensors' MXFP4 preset): per 32 inputs an E8M0 scale 2^ceil(log2(amax * f32(1/6))), the kernels'
#   round-up conversion (`__nv_cvt_float_to_e8m0(..., cudaRoundPosInf)`): the block's largest magnitude lands in (3, 6]
#   and never saturates; no global scale. (llmq's MXFP4 *weights* keep the OCP rule above: a stored exponent means the
#   same to every reader, while activations are rounded by whichever kernel runs, so llmq follows the kernel.)
SIXTH = torch.tensor(1 / 6, dtype=torch.float32)   # the float32 1/6 those kernels multiply the block amax by


def nvfp4_activation_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales [..., K / 16] of activations x [..., K] under the static input global scale (float32 [1])."""
    amax = _act_blocks(x, NVFP4_BLOCK).abs().amax(-1)
    return round_e4m3((amax * SIXTH.to(x.device)) * global_scale.float().to(x.device).reshape(()))


def mxfp4_activation_scales(x: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8) [..., K / 32] of activations x [..., K]: 2^ceil(log2(amax * f32(1/6))), read off
    the float32 bits (never through a logarithm); 0 (2^-127) for an all-zero block, saturating at 2^127."""
    v = _act_blocks(x, MXFP4_BLOCK).abs().amax(-1) * SIXTH.to(x.device)
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF                       # biased exponent of a normal v; 0 for subnormals and zero
    up = (bits & 0x7FFFFF) != 0                     # a mantissa beyond the power of two rounds up
    e = torch.where(exp > 0, exp + up.int(), torch.where(v > 0, _subnormal_ceil(v), 0))
    return e.clamp(0, 254).to(torch.uint8)


def _subnormal_ceil(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) + 127 of float32 subnormals v (> 0), exact: frexp on their float64 values."""
    m, e = torch.frexp(v.double())
    return (e - 1 + (m != 0.5).int() + E8M0_BIAS).int()


def _act_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    x = x.float()
    if x.shape[-1] % block:
        raise ValueError(f"{x.shape[-1]} input features are not a whole number of {block}-wide FP4 blocks")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp4_activation_codes(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A4 activations x [..., K] as (E2M1 codes uint8 [..., K], block scales: E4M3 [..., K / 16] for "nvfp4" under
    `global_scale`, E8M0 uint8 [..., K / 32] for "mxfp4"), computed as the serving kernels do (see above)."""
    if fmt == "nvfp4":
        scale = nvfp4_activation_scales(x, global_scale)
        s = scale.float()
        inv = torch.where(s != 0, 1.0 / (s * (1.0 / global_scale.float().to(x.device).reshape(()))),
                          torch.zeros((), device=x.device))
        xb = _act_blocks(x, NVFP4_BLOCK)
    else:
        scale = mxfp4_activation_scales(x)
        inv = torch.ldexp(torch.ones(scale.shape, device=x.device), E8M0_BIAS - scale.int())   # exact: 2^-e
        xb = _act_blocks(x, MXFP4_BLOCK)
    return e2m1_codes(xb * inv.unsqueeze(-1)).reshape(x.shape), scale


def fp4_activations(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What an FP4 (W4A4) layer multiplies its weight by: (E2M1 value x block scale of x [..., K], bfloat16, exact:
    at most 6 significant bits; the float32 global divisor [1] that real activations are those values over, NVFP4's
    input global scale, or None for MXFP4). The matmul on these values is exact in its operands, and the output divided
    by (input global x weight global) is what the FP4 GEMM computes."""
    codes, scale = fp4_activation_codes(x, fmt, global_scale)
    block = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
    v = _act_blocks(e2m1_values(codes), block) * fp4_block_scale(scale).unsqueeze(-1)
    return v.reshape(x.shape).to(torch.bfloat16), (global_scale.float().reshape(1) if fmt == "nvfp4" else None)
