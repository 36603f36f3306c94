"""llmq.quant, the one module of quantization arithmetic, against float64 references on fresh random data."""

import pytest
import torch

from llmq import quant


def test_round_int_is_round_half_even_then_saturate_on_the_signed_grid():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen, dtype=torch.float64) * 40
    scale = torch.rand(64, 1, generator=gen, dtype=torch.float64) * 0.3 + 0.05
    zero = torch.randint(-8, 8, (64, 1), generator=gen).double()
    for bits in (4, 8):
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        ref = ((x / scale).round() + zero).clamp(lo, hi)  # torch.round: half to even, as rint in the kernels
        assert torch.equal(quant.round_int(x, scale, zero, bits), ref)
        assert quant.int_range(bits) == (lo, hi)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.6, -128.4, -129.0])
    assert quant.round_int(ties, torch.tensor(1.0)).tolist() == [0, 2, 2, -0, -2, 127, -128, -128]


def test_fp8_cast_saturates_and_rounds_to_the_nearest_e4m3():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen, dtype=torch.float64) * 300
    scale = torch.tensor(0.5, dtype=torch.float64)
    q = quant.to_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert float(q.float().abs().max()) == quant.FP8_MAX == 448.0
    inside = (x / scale).abs() <= 448
    y = q.double()[inside]
    # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 relative (normal) or half the 2^-9 subnormal step
    assert ((y - (x / scale)[inside]).abs() <= (x / scale)[inside].abs() * 2 ** -4 + 2 ** -10).all()
    assert (q.double()[~inside].abs() == 448).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_tokens_use_the_engines_per_token_scale_or_the_static_one(fp8):
    gen = torch.Generator().manual_seed(2 + fp8)
    x = torch.randn(9, 80, generator=gen) * torch.logspace(-2, 2, 9)[:, None]
    q, s = quant.quantize_tokens(x, None, fp8)
    qmax = 448.0 if fp8 else 127.0  # vLLM / SGLang: max|x| / 127 (int8), max|x| / 448 (fp8)
    assert torch.allclose(s.double(), x.double().abs().amax(-1, keepdim=True) / qmax, rtol=1e-6)
    deq = q.double() * s.double()
    bound = x.double().abs() * 2 ** -4 + s.double() if fp8 else s.double() / 2 + 1e-9
    assert ((deq - x.double()).abs() <= bound).all()
    assert float(q.double().abs().amax(-1).min()) == qmax  # every token's largest element lands on the grid's end
    static = torch.tensor([0.01])
    q, s = quant.quantize_tokens(x, static, fp8)
    assert s.shape == (9, 1)
    assert bool((s == 0.01).all())
    ref = (x.double() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).double() if fp8 else \
        (x.double() / 0.01).round().clamp(-128, 127)
    assert torch.equal(q.double(), ref)


@pytest.mark.parametrize("shape", ["tensor", "channel", "group"])
def test_dequantize_matches_float64_for_every_scale_shape(shape):
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (24, 64), generator=gen, dtype=torch.int8)
    scale = {"tensor": torch.rand(1, generator=gen), "channel": torch.rand(24, 1, generator=gen),
             "group": torch.rand(24, 4, generator=gen)}[shape].to(torch.bfloat16)
    zero = torch.randint(-8, 8, scale.shape, generator=gen, dtype=torch.int8)
    g = 64 // scale.shape[-1] if scale.dim() == 2 else 64
    expand = lambda t: t.double().reshape(-1, 64 // g).repeat_interleave(g, 1)  # noqa: E731
    ref = (q.double() - expand(zero)) * expand(scale)
    assert torch.allclose(quant.dequantize(q, scale, zero, torch.float64), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_kv_encode_decode_round_trip(fp8):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 3, 16, generator=gen) * torch.tensor([0.5, 4.0, 20.0])[None, :, None]
    scale = quant.absmax_scale(x.abs().amax((0, 2)), fp8).reshape(3, 1)
    q = quant.encode_kv(x, scale, fp8)
    assert q.dtype == (torch.float8_e4m3fn if fp8 else torch.int8)
    y = quant.decode_kv(q, scale, torch.float64)
    bound = x.double().abs() * 2 ** -4 + scale.double() * 2 ** -9 if fp8 else scale.double() / 2 + 1e-9
    assert ((y - x.double()).abs() <= bound).all()
    saturated = quant.encode_kv(torch.tensor([-1e6, 1e6]), torch.tensor(1.0), False)
    assert saturated.tolist() == [-128, 127]  # the whole int8 grid, as compressed-tensors' KV quantization
