"""Quantization arithmetic, once: the integer grid, the FP8 cast and the absmax scales that `llmq quantize`,
`llmq quantize-kv` and the runtime all compute with, so a quality probe measures what serve computes.

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
FP4 weights (NVFP4 / MXFP4, "nvfp4-pack-quantized" / "mxfp4-pack-quantized" in compressed-tensors): E2M1 values
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
bitsandbytes' two schemes (`llmq quantize --method bnb-nf4 / bnb-int8`) keep bitsandbytes' own conventions, since
its checkpoints are read by transformers, vLLM and TGI with its kernels: 4-bit codes looked up in a 16-entry table
(NF4) times one absmax per block of the flattened weight; LLM.int8's rows scaled by SCB / 127 and its activations
quantized per row from float16, with outlier columns kept in floating point.
Block FP8 (DeepSeek-V3, the Qwen3 FP8 releases; compressed-tensors' FP8_BLOCK: weights strategy "block" with
block_structure [128, 128], activations strategy "group" with group_size 128, dynamic): one float32 weight scale per
128 x 128 block, block amax / 448, the weight rounded once from its exact quotient as per-channel FP8 is; shapes that
128 does not divide get ceil-many blocks, the last ones partial (scale [ceil(N / 128), ceil(K / 128)], the weight
itself unpadded, as compressed-tensors pads only while it computes and vLLM allocates). Activations: per token and per
group of 128 input columns (the last group partial), scale group amax / 448 and quotient in float32, as vLLM's
per-token-group quantization kernel computes them.
A leaf: imports nothing of llmq, so models, pipeline and runtime can all use it.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
EPS = 1e-8  # an all-zero row / head still gets a positive scale (its values quantize to 0 either way)
INV_127, INV_127_SQ = 7.874015718698502e-3, 6.200124e-05  # bitsandbytes' LLM.int8 constants: 1/127 and 1/127^2


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


def _blockwise(v: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Flat values v times absmax[i // blocksize] (the last block may be short), in float32."""
    n = v.numel()
    v = torch.nn.functional.pad(v.float(), (0, -n % blocksize)).view(-1, blocksize) * absmax.float().view(-1, 1)
    return v.reshape(-1)[:n]


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' 8-bit blockwise codes (its double-quantized absmax): code[q] * absmax[block], float32, flat."""
    return _blockwise(code.float()[q.reshape(-1).long()], absmax, blocksize)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                    shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' 4-bit weight (NF4 / FP4) as real values: code[q] * absmax[block] in float32, then `dtype`.
    packed holds two codes per byte, the first in the high nibble, over the flattened weight; block b covers
    elements [b * blocksize, (b + 1) * blocksize) of it."""
    n = 1
    for d in shape:
        n *= d
    b = packed.reshape(-1).view(torch.uint8)
    code, idx = code.float(), torch.arange(256, device=b.device)
    pairs = torch.stack([code[idx >> 4], code[idx & 15]], -1)  # byte -> (high, low) values: one gather per byte
    return _blockwise(pairs[b.long()].reshape(-1)[:n], absmax, blocksize).reshape(shape).to(dtype)


def llm_int8_dequantize(q: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An LLM.int8 weight's real values q * SCB / 127 (per row), computed as bitsandbytes does."""
    return (q.float() * scb.float().view(-1, 1) * INV_127).to(dtype)


def llm_int8_activations(x: torch.Tensor, threshold: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """LLM.int8's activation quantization, as bitsandbytes computes it: x [M, K] is cast to float16; entries with
    |x| >= threshold (threshold > 0) are outliers, zeroed before the per-row absmax `row` is taken; x_q =
    round(x * 127 / row). Returns (x_q as float32 integers with the outlier columns zeroed, row [M],
    outlier column indices or None). The caller adds x[:, cols] @ W[:, cols].T in floating point."""
    xh = x.to(torch.float16)
    cols = None
    if threshold > 0:
        out = xh.abs() >= threshold
        cols = out.any(0).nonzero().view(-1)
        xh = xh.masked_fill(out, 0)
    row = xh.abs().amax(1).float()
    q = torch.round(xh * (INT8_MAX / row.unsqueeze(-1)))
    q = torch.nan_to_num(q, nan=0.0)  # an all-zero row: 0 * inf
    if cols is not None and cols.numel():
        q[:, cols] = 0
    return q, row, cols


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


FP8_BLOCK = 128  # block FP8's weight block edge and activation group width


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-block values [ceil(N / bn), ceil(K / bk)] repeated over their blocks and cut to `shape` [N, K]."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per block of x [N, K], partial edge blocks included (zero padding changes no maximum)."""
    n, k = x.shape
    xp = torch.nn.functional.pad(x.abs(), (0, -k % block[1], 0, -n % block[0]))
    return xp.view(xp.shape[0] // block[0], block[0], xp.shape[1] // block[1], block[1]).amax((1, 3))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of w [N, K]: (float8_e4m3fn [N, K], float32 scales [ceil(N / bn), ceil(K / bk)] = block amax / 448),
    each value rounded once from its exact quotient (float64 holds it)."""
    scale = absmax_scale(_block_amax(w.float(), block), fp8=True)
    q = to_fp8(w.double(), _expand(scale, tuple(w.shape), block).double())
    return q, scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block-FP8 weight's real values q * scale[block], computed in float32, then `dtype`."""
    return (q.float() * _expand(scale.float(), tuple(q.shape), block)).to(dtype)


def quantize_token_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] in float8 per token and group of `group` columns: (float8_e4m3fn [M, K], float32 scales
    [M, ceil(K / group)] = group amax / 448), the quotient in float32."""
    xf = x.float()
    s = absmax_scale(_block_amax(xf, (1, group)), fp8=True)
    return to_fp8(xf, _expand(s, tuple(xf.shape), (1, group))), s


# GGML's Q4_K ("k-quant" 4-bit), llama.cpp's ggml-common.h block_q4_K / ggml-quants.c: a row is cut into super-blocks
# of 256 weights, each 8 sub-blocks of 32. Weight = d * sc * n - dmin * m, n in [0, 15] (a nibble), sc and m 6-bit
# integers [0, 63] per sub-block, d and dmin fp16 per super-block. A super-block is 144 bytes: d, dmin (fp16, little
# endian), 12 bytes of packed sc / m (bytes 0-3: sc[0..3] in the low 6 bits, bytes 4-7: m[0..3]; bytes 8-11: the low
# nibbles of sc[4..7] and, high nibble, of m[4..7]; the top 2 bits of sc[4..7] / m[4..7] in the top 2 bits of bytes
# 0-3 / 4-7), then 128 bytes of nibbles: each 64 weights are 32 bytes, weight l in the low nibble of byte l and
# weight 32 + l in the high one. Dequantization (dequantize_row_q4_K, gguf-py's Q4_K): s = d * sc and mn = dmin * m in
# float32 (both exact: 11 x 6 significant bits), then s * n (exact: at most 21 bits) - mn, rounded once to float32.
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
