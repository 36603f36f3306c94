"""llama.cpp's CPU matrix products, activation side: what a weight of each GGML type is multiplied with.

ggml-cpu never multiplies a quantized (or 16-bit) weight by float32 activations: it first converts each activation
row to the weight type's `vec_dot_type` (type_traits_cpu in ggml-cpu.c) and its dot products read those values, so
llama.cpp computes with activations rounded as follows (x86 with AVX2 or later, the builds these machines run):
- Q8_0 (for Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4 and NVFP4 weights; Q8_1 for Q4_1 / Q5_1 is the same values, plus a
  block sum only its asymmetric dot product reads): per 32 inputs, q = round-half-even(x * (127 / amax)) in float32
  and the block scale d = amax / 127 rounded to fp16, so the product sees q * fp16(d). This is quant.quantize_blocks
  (the runtime's int8-activation kernels) but for the fp16 scale and the multiplication by a reciprocal;
- Q8_K (for the k-quants Q2_K..Q6_K and IQ4_XS): per 256 inputs, with m the input of largest magnitude (sign kept), q =
  min(127, round-half-even(x * (-127 / m))) and a float32 scale 1 / (-127 / m);
- F16 / BF16 (16-bit weights): the activations cast to that type (round to nearest even); F32: as they are.
The integer sums of the block products are exact, so the result is these values times the dequantized weight, up to
float32 summation order.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32    # inputs per Q8_0 / Q8_1 activation block
QK_K = 256       # inputs per Q8_K activation block

# GGML weight type -> the type ggml-cpu converts activations to before the dot products (type_traits_cpu)
VEC_DOT_TYPE = {"F32": "F32", "F16": "F16", "BF16": "BF16",
                "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0", "NVFP4": "Q8_0",
                "Q4_1": "Q8_1", "Q5_1": "Q8_1",
                "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K"}


def _div(a: float, t: torch.Tensor) -> torch.Tensor:
    """a / t correctly rounded in float32, as C divides (PyTorch computes `a / t` as t.reciprocal() * a)."""
    return torch.full_like(t, a) / t


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    xb = x.view(m, k // Q8_BLOCK, Q8_BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, _div(127.0, amax), torch.zeros_like(amax))   # float32, as `id` in quantize_row_q8_0
    d = (amax / 127.0).to(torch.float16).float()
    return (torch.round(xb * inv) * d).view(m, k)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    xb = x.view(m, k // QK_K, QK_K)
    signed_max = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))   # the first of equal magnitudes, as the C loop
    iscale = torch.where(signed_max != 0, _div(-127.0, signed_max), torch.zeros_like(signed_max))
    q = torch.round(xb * iscale).clamp_max(127)
    d = torch.where(iscale != 0, _div(1.0, iscale), torch.zeros_like(iscale))
    return (q * d).view(m, k)


def ggml_activations(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    """x [M, K] (float32) as ggml-cpu's dot products with a `weight_type` weight read it, in float32."""
    vdt = VEC_DOT_TYPE.get(weight_type)
    if vdt is None:
        raise ValueError(f"no modelled ggml-cpu activation type for {weight_type} weights")
    x = x.float().contiguous()
    block = {"Q8_0": Q8_BLOCK, "Q8_1": Q8_BLOCK, "Q8_K": QK_K}.get(vdt, 1)
    if x.shape[-1] % block:
        raise ValueError(f"{x.shape[-1]} inputs do not fill {vdt}'s {block}-input blocks")
    if vdt in ("Q8_0", "Q8_1"):
        return _q8_0(x)
    if vdt == "Q8_K":
        return _q8_k(x)
    if vdt == "F32":
        return x
    return x.to(torch.float16 if vdt == "F16" else torch.bfloat16).float()
