"""llmq's CPU kernels (runtime/layers/cpu_kernels) against the eager PyTorch code they replace, or a float64 reference
of their arithmetic, on fresh random inputs; and the whole model with and without them."""

import ctypes
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from llmq import quant
from llmq.models.spec import attends
from llmq.runtime.kv_cache import allocate_kv_cache
from llmq.runtime.layers import cpu_kernels
from llmq.runtime.layers import stack as layer_stack
from llmq.runtime.layers.attention import AttentionMetadata, _decode, _decode_sdpa, rotate_and_store
from llmq.runtime.layers.linear import DenseLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear
from llmq.runtime.layers.norm import RMSNorm
from llmq.runtime.layers.rotary import RotaryEmbedding

VNNI = set(cpu_kernels._VNNI) <= cpu_kernels.cpu_flags()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the low-bit kernels need AVX512-VNNI, which this CPU lacks")
BF16 = {"avx512bw", "avx512_bf16"} <= cpu_kernels.cpu_flags()
needs_bf16 = pytest.mark.skipif(not BF16, reason="lowbit_linear_bf16 needs AVX512-BF16, which this CPU lacks")
needs_fp8 = pytest.mark.skipif(not cpu_kernels.FP8_FLAGS <= cpu_kernels.cpu_flags(),
                               reason="fp8_linear needs AVX512-VBMI and AVX512-BF16, which this CPU lacks")
AVX512 = "avx512bw" in cpu_kernels.cpu_flags()
needs_avx512 = pytest.mark.skipif(not AVX512, reason="this kernel needs AVX-512, which this CPU lacks")
needs_avx2 = pytest.mark.skipif(not cpu_kernels.AVX2 <= cpu_kernels.cpu_flags(),   # INT4 / INT5 / Q4_K's kernels
                                reason="the INT4-tile kernels need AVX2 and FMA at least, which this CPU lacks")


@pytest.fixture(params=[True, False], ids=["amx", "vector"])
def amx(request):
    """Each test twice: with the AMX path on (where Linux grants it, from a few rows) and off; on again afterwards."""
    assert cpu_kernels.available()
    yield cpu_kernels.amx(request.param)
    cpu_kernels.amx(True)


@pytest.fixture
def avx2_only():
    """The INT4-tile products' AVX2 + FMA loops forced, as a CPU without AVX512-BF16 runs them (this one may have it);
    off again afterwards."""
    assert cpu_kernels.available()
    yield cpu_kernels.avx2_only(True)
    cpu_kernels.avx2_only(False)


def test_kernels_build_here():
    """CI's machine has a compiler and ninja (a dependency): the kernels must build, not fall back silently."""
    assert cpu_kernels.available()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _weight(bits: int, n: int, k: int, group: int, asym: bool, gen: torch.Generator):
    qmin, qmax = quant.int_range(bits)
    if asym:
        q = torch.randint(0, 2 ** bits, (n, k), generator=gen)
        zero = torch.randint(0, 2 ** bits, (n, k // group), generator=gen).float()
    else:
        q, zero = torch.randint(qmin, qmax + 1, (n, k), generator=gen), None
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    return q, scale, zero


@needs_vnni
@pytest.mark.parametrize("bits,n,k,group,asym", [(4, 96, 576, 64, False), (4, 64, 256, 32, True),
                                                 (4, 48, 384, 128, False), (8, 80, 1536, 1536, False),
                                                 (8, 32, 256, 64, True)])
@pytest.mark.parametrize("bf16_scales", [False, True])
def test_lowbit_linear_equals_its_float64_arithmetic(bits, n, k, group, asym, bf16_scales):
    gen = torch.Generator().manual_seed(1000 * bits + n)
    q, scale, zero = _weight(bits, n, k, group, asym, gen)
    if bf16_scales:  # as llmq's artifacts store them: packed as bfloat16, exactly
        scale = scale.bfloat16().float()
    packed = cpu_kernels.pack(q, scale, zero, bits)
    assert packed[1].dtype == (torch.bfloat16 if bf16_scales else torch.float32)
    assert packed[2].numel() == (packed[1].numel() if asym else 0)  # symmetric: no zero-point term stored
    exact_w = quant.dequantize(q, scale, zero, torch.float64)
    for m in (1, 5, 37):
        x = torch.randn(m, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)  # uneven channels
        y = cpu_kernels.lowbit_linear(x, *packed, bits, group)
        assert y.shape == (m, n)
        assert y.dtype == torch.float32
        assert _rel(y, cpu_kernels.reference(x, q, scale, zero)) < 1e-5  # only float32 summation order differs
        # the activations' int8 rounding is the one approximation: small, and not zero (it is really applied)
        assert 1e-4 < _rel(y, x.double() @ exact_w.t()) < 2e-2


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(45, 112), (96, 576), (37, 256)])  # 112: every loop of the decode row (64, 32, 16)
def test_dense16_linear_is_float32_arithmetic(dtype, n, k, amx):
    """The 16-bit weight widened exactly, float32 products and sums: against float64 within float32 summation error,
    far inside what rounding x to 16 bits would cost (~1e-4 of the sum of |products| here). Row counts cover the
    row-at-a-time path, up to 15 rows sharing each load (4 + 4 + 1: the last row alone) and batches of 8, 4, 1; on
    AMX where granted (K % 32 == 0; x split exactly into three bfloat16, float16 weights into two; 37 rows: a last
    tile of 5)."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    for m in (1, 2, 3, 6, 9, 16, 21, 29, 33):
        x = torch.randn(m, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        y = cpu_kernels.dense16_linear(x, w)
        want = x.double() @ w.double().t()
        bound = 1e-6 * (x.double().abs() @ w.double().abs().t())
        assert y.dtype == torch.float32
        assert y.shape == (m, n)
        assert bool(((y.double() - want).abs() <= bound).all())


@needs_avx512
def test_dense_layer_keeps_a_16bit_weight_as_stored():
    """A bfloat16 weight computed in float32 stays bfloat16 (half the bytes a step reads) and gives F.linear's numbers
    on its float32 cast, on the kernel and on the PyTorch path a compiled graph takes."""
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(48, generator=gen)
    layer = DenseLinear(w, b, torch.float32)
    assert layer.dense16
    assert layer.weight.dtype == torch.bfloat16
    assert layer.weight.data_ptr() == w.data_ptr()
    assert layer.nbytes == 48 * 64 * 2 + 48 * 4
    x = torch.randn(2, 5, 64, generator=gen)
    want = F.linear(x, w.float(), b)
    assert float((layer(x) - want).abs().max()) < 1e-5 * float(want.abs().max())
    with mock.patch.object(cpu_kernels, "usable", lambda t: False):
        assert torch.equal(layer(x), want)
    assert not DenseLinear(w, b, torch.bfloat16).dense16
    assert not DenseLinear(w.float(), b).dense16


def test_quantize_blocks_is_absmax_per_32():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    xq, d = quant.quantize_blocks(x, 32)
    assert d.shape == (3, 3)
    assert torch.equal(xq, xq.round())
    assert float(xq.abs().max()) == 127
    assert torch.equal(xq.view(3, 3, 32).abs().amax(-1), torch.full((3, 3), 127.0))
    err = (xq.view(3, 3, 32) * d.unsqueeze(-1) - x.view(3, 3, 32)).abs()
    assert bool((err <= d.unsqueeze(-1) / 2 * (1 + 1e-6)).all())


@needs_vnni
@pytest.mark.parametrize("cls,bits", [(Int4WeightOnlyLinear, 4), (Int8WeightOnlyLinear, 8)])
def test_weight_only_layers_run_the_lowbit_kernel(cls, bits):
    gen = torch.Generator().manual_seed(bits)
    q, scale, zero = _weight(bits, 64, 256, 64, False, gen)
    bias = torch.randn(64, generator=gen)
    layer = cls(q, scale, zero, bias, torch.float32, int8_activations=True)
    assert layer.lowbit == (bits, 64, True)
    x = torch.randn(2, 3, 256, generator=gen)
    want = cpu_kernels.reference(x.view(6, 256), q, scale, zero).view(2, 3, 64) + bias.double()
    assert _rel(layer(x), want) < 1e-5
    default = cls(q, scale, zero, bias, torch.float32)  # 16-bit activations: a different rounding of the same product
    assert default.lowbit is None  # float32 scales: PyTorch's kernel (it rounds them)
    exact16 = cls(q, scale.bfloat16().float(), zero, bias, torch.float32)   # INT8 in groups too: no PyTorch kernel
    assert exact16.lowbit == ((bits, 64, False) if (BF16 if bits == 4 else AVX512) else None)
    assert _rel(default(x), want) < 2e-2


def _within_rounding(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y is ref (a float64 product rounded to bfloat16) up to one bfloat16 step plus float32 summation error (which a
    sum that cancels makes large relative to itself: bounded by K * 2^-24 * sum |x w|)."""
    bound = ref.abs() * 2 ** -7 + x.shape[1] * 2 ** -24 * (x.double().abs() @ w.abs().t()).float()
    return bool(((y - ref).abs() <= bound).all())


def test_amx_is_on_only_where_linux_grants_the_tiles():
    """The AMX path is taken where the kernel granted this process the tile state (arch_prctl, read back here
    independently), never on the cpuid bits alone (a VM may advertise AMX and fault on it), and can be turned off."""
    assert cpu_kernels.available()
    on = cpu_kernels.amx(True)
    if {"amx_bf16", "amx_tile"} - cpu_kernels.cpu_flags():
        assert not on
    else:
        perm = ctypes.c_ulong(0)
        got = ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(perm))  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
        assert on == (got == 0 and bool(perm.value >> 18 & 1))  # XFEATURE_XTILEDATA
    assert not cpu_kernels.amx(False)
    cpu_kernels.amx(True)


@pytest.mark.parametrize("bits,n,k,group", [pytest.param(4, 96, 576, 64, marks=needs_bf16),
                                            pytest.param(4, 64, 256, 32, marks=needs_bf16),
                                            pytest.param(4, 48, 1536, 128, marks=needs_bf16),
                                            pytest.param(4, 80, 256, 256, marks=needs_bf16),  # odd tiles, per channel
                                            pytest.param(5, 96, 576, 32, marks=needs_bf16),
                                            pytest.param(5, 48, 1536, 128, marks=needs_bf16),
                                            pytest.param(5, 32, 256, 256, marks=needs_bf16),  # per channel
                                            *[pytest.param(8, n, k, g, marks=needs_avx512) for n, k, g in
                                              ((96, 576, 576), (32, 1536, 1536), (48, 256, 64),
                                               (16, 240, 40))]])  # 40: groups not a multiple of 16 inputs
def test_lowbit_linear_bf16_is_pytorchs_arithmetic(bits, n, k, group, amx):
    """bfloat16(x) times the exact symmetric INT4 / INT5 / INT8 weights, float32 sums, rounded to bfloat16 (what
    aten._weight_int4pack_mm_for_cpu / _weight_int8pack_mm compute): against that in float64, where only the float32
    summation order may move an output to a neighbouring bfloat16 value, and against PyTorch's kernels themselves
    (INT5, and INT8 in groups: against float64 only, PyTorch's INT8 kernel takes one scale a channel). On the vector
    path and, from 10 / 8 rows where the CPU grants it, on AMX (scaled weights split exactly into two bfloat16; 240
    inputs: not a whole number of AMX steps, so the vector path). Every INT5 code and fifth bit is drawn."""
    _check_lowbit_bf16(bits, n, k, group)


@pytest.mark.parametrize("bits,n,k,group", [(4, 96, 576, 64), (4, 48, 1536, 128), (4, 80, 256, 256), (5, 96, 576, 32),
                                            (5, 48, 1536, 128), (5, 32, 256, 256)])
def test_lowbit_linear_bf16_without_avx512_is_pytorchs_arithmetic(bits, n, k, group, avx2_only):
    """The INT4 / INT5 product on the AVX2 loops (a row at a time, and from 6 rows the dequantized weight on the
    BLAS), held to the same checks as the AVX-512 path."""
    _check_lowbit_bf16(bits, n, k, group)


def _check_lowbit_bf16(bits, n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    q, scale, _ = _weight(bits, n, k, group, False, gen)
    scale = scale.bfloat16().float()  # as llmq's artifacts store them
    codes, s, sz = cpu_kernels.pack(q, scale, None, bits)
    assert sz.numel() == 0
    assert s.dtype == torch.bfloat16
    cls = Int4WeightOnlyLinear if bits == 4 else Int8WeightOnlyLinear
    with mock.patch.object(cpu_kernels, "usable", lambda t: False):
        pytorchs = cls(q, scale, None, None, torch.float32) if bits == 4 or bits == 8 and group == k else None
    assert pytorchs is None or (not pytorchs.lowbit and (pytorchs.packed if bits == 4 else pytorchs.kernel))
    exact_w = quant.dequantize(q, scale, None, torch.float64)
    for m in (1, 3, 4, 7, 8, 9, 10, 13, 16, 21, 33, 64):  # alone, in fours, eights (INT8: pairs); AMX: 16s, 32s
        x = torch.randn(m, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        y = cpu_kernels.lowbit_linear_bf16(x, codes, s, bits, group)
        assert y.shape == (m, n)
        assert y.dtype == torch.float32
        assert torch.equal(y.bfloat16().float(), y)
        xb = x.bfloat16().float()
        ref = (xb.double() @ exact_w.t()).bfloat16().float()
        assert _within_rounding(y, ref, xb, exact_w)
        assert float((y == ref).float().mean()) > 0.99
        if pytorchs is not None and (bits == 4 or m <= pytorchs.max_kernel_rows):   # PyTorch's INT8 kernel: 8 rows
            theirs = pytorchs(x)
            assert _within_rounding(y, theirs, xb, exact_w)
            assert float((y == theirs).float().mean()) > 0.99


@needs_bf16
@pytest.mark.parametrize("n,k", [(48, 512), (32, 256)])
def test_q4k_linear_is_bfloat16_x_times_llama_cpps_dequantized_weight(n, k, amx):
    """Q4_K codes with random d / dmin / 6-bit sc / m: bfloat16(x) times the float64 product of the weight
    llama.cpp's dequantize_row_q4_K gives (quant.dequantize_q4_k), up to float32 summation (and the one float32
    rounding of s * n - mn it makes), for one row, fours, eights and more than a tile of 16 (on AMX from 16 rows,
    where granted); the min term (x's group sums) is what makes the unsigned codes right, so a lost or misplaced one
    fails by orders of magnitude. One-hot rows pick out single weights, which must come back as llama.cpp's float32
    values exactly (AMX's three bfloat16 planes of each weight lose its last bits if one is dropped)."""
    _check_q4k(n, k)


@pytest.mark.parametrize("n,k", [(48, 512), (32, 256)])
def test_q4k_linear_without_avx512_is_llama_cpps_product(n, k, avx2_only):
    """Q4_K on the AVX2 loops, held to the same checks as the AVX-512 path (the one-hot picks: on the BLAS path's
    dequantized weight)."""
    _check_q4k(n, k)


def _check_q4k(n, k):
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.02).half()
    dmin = (torch.rand(n, k // 256, generator=gen) * 0.02).half()
    sc, m = torch.randint(0, 64, (n, k // 32), generator=gen), torch.randint(0, 64, (n, k // 32), generator=gen)
    packed = cpu_kernels.pack_q4k(q, *quant.q4_k_scale_min(d, dmin, sc, m))
    w = quant.dequantize_q4_k(q, d, dmin, sc, m, torch.float64)
    for rows in (1, 4, 8, 13, 21):
        x = torch.randn(rows, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        y = cpu_kernels.q4k_linear(x, *packed)
        xb = x.bfloat16().double()
        ref = xb @ w.t()
        bound = 2 * k * 2 ** -24 * (xb.abs() @ w.abs().t())
        assert y.shape == (rows, n), rows
        assert bool(((y.double() - ref).abs() <= bound).all()), rows
    cols = torch.randperm(k, generator=gen)[:21]
    picked = cpu_kernels.q4k_linear(torch.eye(k)[cols], *packed)
    assert torch.equal(picked, quant.dequantize_q4_k(q, d, dmin, sc, m, torch.float32)[:, cols].t())


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_table_linear_is_float32_x_times_the_weight_rounded_as_bitsandbytes_rounds_it(dtype, amx):
    """bitsandbytes' NF4 / FP4 arithmetic (a 16-value table times a float32 absmax per block, rounded to the
    checkpoint's dtype) times float32 x: the float64 product up to float32 summation, for one row to more than a tile
    of 16 (on AMX from 12 rows where granted and at most three tile products a step: bfloat16 weights, or bfloat16
    x). One-hot rows must give back each weight exactly, and one-hot rows of any float32 value the product within
    2^-21 (AMX's sums of the parts round twice): AMX splits x into three bfloat16 (one if it is bfloat16) and the
    weights into one to three, and a dropped part (2^-16 and more) fails these."""
    _check_table_linear(dtype)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_table_linear_without_avx512_is_the_same_arithmetic(dtype, avx2_only):
    """table_linear on the AVX2 loops (a row at a time; from 6 rows the rounded weight on the BLAS), held to the same
    checks."""
    _check_table_linear(dtype)


def _check_table_linear(dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    n, k, group = 48, 256, 64
    table = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values
    codes = torch.randint(0, 16, (n, k), generator=gen)
    absmax = torch.rand(n, k // group, generator=gen) * 0.1 + 1e-3
    w = (table[codes] * absmax.repeat_interleave(group, 1)).to(dtype).float()
    packed = cpu_kernels.pack_codes(codes, 4), cpu_kernels.pack_scales(absmax).float()
    for rows, x_dtype in ((1, torch.float32), (5, torch.float32), (13, torch.float32), (21, torch.float32),
                          (21, torch.bfloat16)):   # a bfloat16 x takes one part on AMX
        x = (torch.randn(rows, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)).to(x_dtype)
        y = cpu_kernels.table_linear(x, *packed, table, group, dtype)
        want, size = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
        assert y.shape == (rows, n)
        assert bool(((y.double() - want).abs() <= 2 * k * 2 ** -24 * size).all()), rows
    cols = torch.randperm(k, generator=gen)[:21]
    for x_dtype in (torch.float32, torch.bfloat16):
        one_hot = torch.eye(k)[cols].to(x_dtype)
        assert torch.equal(cpu_kernels.table_linear(one_hot, *packed, table, group, dtype), w[:, cols].t()), x_dtype
    scale = torch.randn(21, 1, generator=gen)
    picked = cpu_kernels.table_linear(torch.eye(k)[cols] * scale, *packed, table, group, dtype).double()
    want = w[:, cols].t().double() * scale.double()
    assert bool(((picked - want).abs() <= 2 ** -21 * want.abs()).all())


@needs_fp8
def test_fp8_activation_rounding_is_quantize_token_groups_bit_for_bit():
    """fp8_linear's in-kernel rounding of activations to E4M3 per row and group against quant.quantize_token_groups:
    the same scales and values, bit for bit, on random rows of every magnitude, short last groups, zero rows, and rows
    made of exact ties (a group scaled by 1 whose values lie halfway between E4M3 neighbours, subnormal ones too)."""
    _check_fp8_rounding()


@needs_avx2
def test_fp8_activation_rounding_without_avx512_is_quantize_token_groups_bit_for_bit(avx2_only):
    """The AVX2 loops' rounding, held to the same checks."""
    _check_fp8_rounding()


def _check_fp8_rounding():
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 200, generator=gen) * torch.exp2(torch.randint(-30, 30, (37, 1), generator=gen).float())
    x[5] = 0
    x[6, 8:] = 0   # one group all zero: the eps scale
    grid = torch.arange(256, dtype=torch.uint8).view(quant.FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2    # every halfway point of the non-negative E4M3 values, exact in float32
    ties = torch.cat([mids, -mids]).view(2, -1)[:, :120]
    ties[:, 0] = 448    # the group's amax: scale 448 / 448 = 1, so the quotients are the ties themselves
    for rows, group in ((x, 128), (x[:, :96], 32), (ties.repeat(3, 1), 120)):
        q, s = cpu_kernels.fp8_token_groups(rows, group)
        wq, ws = quant.quantize_token_groups(rows, group)
        assert torch.equal(s, ws)
        assert torch.equal(q.view(torch.int32), wq.float().view(torch.int32)), group
    assert bool((cpu_kernels.fp8_token_groups(ties, 120)[0] != ties)[:, 1:].all())  # every tie moved to a neighbour


FP8_SHAPES = [(48, 512, (128, 128)), (32, 256, (16, 64)), (48, 576, (128, 128))]


@needs_fp8
@pytest.mark.parametrize("n,k,block", FP8_SHAPES)
def test_fp8_linear_decodes_every_e4m3_code_as_the_float64_reference(n, k, block, amx):
    """Every E4M3 weight code but NaN (subnormals, both zeros, 448), with float32 block scales and activations rounded
    to E4M3 per group as the layer rounds them: every product exact, so the kernel is the float64 product up to
    float32 summation, for one row, several and more than a block of 8 (on AMX from 8 rows, where granted); 576 inputs
    (SmolLM2's width) end in a half block."""
    _check_fp8_linear(n, k, block)


@needs_avx2
@pytest.mark.parametrize("n,k,block", FP8_SHAPES)
def test_fp8_linear_without_avx512_decodes_every_e4m3_code_as_the_float64_reference(n, k, block, avx2_only):
    """fp8_linear on the AVX2 loops (a row at a time; from 6 rows x's values times their scales against the
    dequantized weight on the BLAS: one float32 rounding more a term), held to the same bound."""
    _check_fp8_linear(n, k, block)


def _check_fp8_linear(n, k, block):
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(k)
    codes = torch.arange(256, dtype=torch.uint8).repeat(n * k // 256)[torch.randperm(n * k, generator=gen)].view(n, k)
    codes[(codes & 0x7F) == 0x7F] = 0x38   # NaN -> 1.0
    q = codes.view(quant.FP8)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) + 0.5
    w = quant.dequantize_fp8_blocks(q, scale, block, torch.float64)
    packed = cpu_kernels.pack_fp8(q, scale, block)
    for rows in (1, 3, 4, 9, 21):
        x = torch.randn(rows, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        xq, xs = quant.quantize_token_groups(x, block[1])
        xd = quant.dequantize_fp8_blocks(xq, xs, (1, block[1]), torch.float64)
        y = cpu_kernels.fp8_linear(x, *packed, block[1])
        bound = 2 * k * 2 ** -24 * (xd.abs() @ w.abs().t())
        assert y.shape == (rows, n), rows
        assert bool(((y.double() - xd @ w.t()).abs() <= bound).all()), rows


@needs_avx512
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_decodes_every_code_and_scale_as_the_float64_reference(fmt, amx):
    """fp4_linear on packed codes against x (float32) times quant.dequantize_fp4's weight in float64: every code in
    every position of a block, every finite positive E4M3 scale (and zero: an all-zero block) with NVFP4's global
    divisor, E8M0 scales 2^-100..2^98; rows alone and in fours, and from 12 rows on AMX where granted (x split exactly
    into three bfloat16). Each output's error against the sum of its terms' magnitudes is float32 summation error (a
    few 2^-24); a wrong code, scale, nibble or divisor is O(1), a lost part of x 2^-8 or 2^-16."""
    _check_fp4(fmt)


@needs_avx2
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_without_avx512_decodes_as_the_float64_reference(fmt, avx2_only):
    """fp4_linear on the AVX2 loops (a row at a time; from 6 rows the dequantized weight on the BLAS), held to the
    same checks as the AVX-512 path."""
    _check_fp4(fmt)


def _check_fp4(fmt):
    gen = torch.Generator().manual_seed(len(fmt))
    n, k, group = 128, 256, 16 if fmt == "nvfp4" else 32
    groups = k // group
    codes = ((torch.arange(n).unsqueeze(1) + torch.arange(k)) % 16).to(torch.uint8)
    pair = torch.arange(n * groups).reshape(n, groups)
    if fmt == "nvfp4":
        scale, glob = (pair % 127).to(torch.uint8).view(torch.float8_e4m3fn), torch.tensor(1234.5678)
    else:
        scale, glob = (27 + 2 * (pair % 100)).to(torch.uint8), None
    w = quant.dequantize_fp4(codes, scale, glob, torch.float64)
    s = cpu_kernels.pack_scales(quant.fp4_block_scale(scale))
    assert s.dtype == torch.bfloat16   # E4M3 and E8M0 scales are exact in bfloat16: 2 bytes a block
    packed = cpu_kernels.pack_codes(codes, 4)
    assert packed.numel() == n * k // 2
    for m in (1, 3, 4, 7, 12, 16, 33):
        x = torch.randn(m, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        y = cpu_kernels.fp4_linear(x, packed, s, group, float(glob) if glob is not None else 1.0)
        size = x.double().abs() @ w.abs().t()
        err = (y.double() - x.double() @ w.t()).abs() / torch.where(size > 0, size, 1.0)
        assert y.shape == (m, n), (fmt, m, float(err.max()))
        assert float(err.max()) < 1e-6, (fmt, m, float(err.max()))


@needs_avx2
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_models_stay_packed_and_the_kv_budget_counts_what_they_hold(tmp_path, make_tiny_model, fmt):
    """On a CPU with AVX-512 or AVX2 an FP4 model's linears hold their codes packed (a quarter of the dense path's
    bfloat16 weight, plus bfloat16 block scales) and runtime_bytes with keeps_as_stored prices that, not the dense
    weight."""
    import functools

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime import EngineConfig, LLMEngine
    from llmq.runtime.layers.fp4 import FP4Linear
    from llmq.runtime.layers.linear import keeps_as_stored

    store = Store(tmp_path / "store")
    d = make_tiny_model(tmp_path / "m", seed=3, tie_word_embeddings=True)
    art = quantize(resolve_model(str(d), store), QuantizeOptions(method=fmt, probe_tokens=0), store, progress=False)
    eng = LLMEngine(art.path, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    model = eng.runner.model
    layers = [m for m in model.modules() if isinstance(m, FP4Linear)]
    assert layers
    assert all(m.dense is None and m.divisor is not None for m in layers)
    held = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if not n.startswith("rotary.") and t.data_ptr() != model.embed.data_ptr()) + model.embed.nbytes
    eng.shutdown()
    ckpt = CheckpointReader(art.path)
    estimate = ckpt.runtime_bytes(torch.float32, functools.partial(keeps_as_stored, dtype=torch.float32, device="cpu"))
    assert 0.9 * held <= estimate < 1.1 * held < ckpt.runtime_bytes(torch.float32)


@needs_bf16
@pytest.mark.parametrize("k", [320, 576])
def test_int8_layers_compute_alike_at_every_batch_size(k):
    """An INT8 layer on llmq's kernels computes bfloat16(x) times the exact weights, float32 sums, bfloat16 out at
    every batch size: a row's output is the one it gets alone (up to float32 summation order: within one bfloat16
    step, almost always equal), from 8 rows on the tiles widened to bfloat16 pairs. Before, batches above 8 rows
    took float32 x, so a sequence's numbers depended on the batch it was in."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(8)
    q, scale, _ = _weight(8, 48, k, k, False, gen)   # per channel, as llmq's INT8 layers and tables store it
    scale = scale.bfloat16().float()
    exact = quant.dequantize(q, scale, None, torch.float64)
    layer = Int8WeightOnlyLinear(q, scale, None, None, torch.float32, int8_activations=False)
    assert layer.lowbit == (8, k, False)
    for m in (9, 21, 40):
        x = torch.randn(m, k, generator=gen) * (torch.rand(1, k, generator=gen) * 4)
        got, alone = layer(x), torch.cat([layer(row) for row in x.split(1)])
        xb = x.bfloat16().float()
        ref = (xb.double() @ exact.t()).bfloat16().float()
        assert _within_rounding(got, ref, xb, exact)
        assert _within_rounding(got, alone, xb, exact)
        assert float((got == alone).float().mean()) > 0.99


@needs_bf16
@pytest.mark.parametrize("asym,bf16_scales", [(True, True), (False, False)])
def test_int4_layers_keep_pytorchs_kernel_where_it_rounds(asym, bf16_scales):
    """PyTorch's kernel rounds scales and a zero-point term to bfloat16; lowbit_linear_bf16 would not, so layers with
    zero points or scales that bfloat16 does not hold keep it (its numbers are the ones the probe measured)."""
    gen = torch.Generator().manual_seed(3)
    q, scale, zero = _weight(4, 64, 256, 64, asym, gen)
    layer = Int4WeightOnlyLinear(q, scale.bfloat16().float() if bf16_scales else scale, zero, None, torch.float32)
    assert layer.lowbit is None
    assert layer.packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_eager(dtype):
    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm((torch.rand(576, generator=gen) + 0.5).to(dtype), 1e-5)
    x = (torch.randn(2, 9, 576, generator=gen) * 3).to(dtype)
    got, want = norm(x), norm.eager(x)
    assert got.shape == want.shape
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bf16: at most a last-bit difference of the rounding
    assert float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_eager(dtype):
    gu = (torch.randn(5, 2 * 200, generator=torch.Generator().manual_seed(3)) * 6).to(dtype)  # both signs, tails
    g, u = gu.chunk(2, dim=-1)
    want = F.silu(g.clone()).mul_(u)  # what DecoderLayer computes op by op
    got = cpu_kernels.silu_mul(gu)
    assert got.dtype == dtype
    assert got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # own exp (~1e-7); 16-bit: at most a rounding step apart
    assert float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()) < tol


def _cache(dtype, gen, layers=1, head_dim=64):
    caches = allocate_kv_cache([(3, head_dim)] * layers, 24, 16, "auto", dtype, "cpu", None)
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=gen).to(dtype))
        c.v.copy_(torch.randn(c.v.shape, generator=gen).to(dtype))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,head_dim", [(None, 64), (21, 64), (None, 128), (None, 96), (None, 40)])
# 64 / 128: specialised code; 96: any multiple of 16; 40: the scalar loops. float32 / bfloat16 caches are read in
# place, float16 ones widened into rows first; 80 positions: scores 16 at a time and one by one, two chunks.
def test_decode_attention_equals_sdpa(dtype, window, head_dim):
    gen = torch.Generator().manual_seed(11)
    (cache,) = _cache(dtype, gen, head_dim=head_dim)
    blocks = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 9, 11, 20], [4, 0, 0, 0, 0]])  # scattered, padded with block 0
    last = torch.tensor([40, 79, 5])  # each sequence's query position
    mask = attends(last[:, None], torch.arange(80)[None, :], window).view(3, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), num_decode=3, decode_blocks=blocks,
                             decode_mask=mask)
    q = (torch.randn(3, 9, head_dim, generator=gen) * 2).to(dtype)
    got, want = _decode(q, cache, meta, head_dim ** -0.5), _decode_sdpa(q, cache, meta, head_dim ** -0.5)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert float((got.float() - want.float()).abs().max()) < tol * float(want.float().abs().max())


@pytest.mark.parametrize("decode", [_decode, _decode_sdpa])
def test_decode_attention_with_sinks_is_the_softmax_over_scores_and_sinks(decode):
    """Each head's sink logit (GPT-OSS) is one more softmax term with no value: against that softmax in float64, on
    llmq's kernel and on the SDPA path (quantized caches, GPUs); sinks from far below to far above the scores."""
    gen = torch.Generator().manual_seed(17)
    (cache,) = _cache(torch.float32, gen)
    blocks = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 9, 11, 20]])
    last = torch.tensor([40, 79])
    mask = attends(last[:, None], torch.arange(80)[None, :], 30).view(2, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.long), num_decode=2, decode_blocks=blocks,
                             decode_mask=mask)
    q = torch.randn(2, 9, 64, generator=gen) * 2
    sinks = torch.linspace(-20, 20, 9)
    got = decode(q, cache, meta, 0.125, sinks)
    for b in range(2):
        rows = (blocks[b][:, None] * 16 + torch.arange(16)).flatten()[mask[b].flatten()]
        k, v = cache.k.flatten(0, 1)[rows].double(), cache.v.flatten(0, 1)[rows].double()  # [S, 3, 64]
        for h in range(9):
            scores = k[:, h // 3] @ q[b, h].double() * 0.125
            p = torch.cat([scores, sinks[h:h + 1].double()]).softmax(0)[:-1]
            want = p @ v[:, h // 3]
            assert float((got[b, h].double() - want).abs().max()) <= 2e-6 * float(want.abs().max()), (b, h)


def _gated_delta_reference(mixed, tail, state, conv, neg_rate, dt_bias, norm, eps, key_heads, key_dim):
    """One decode token of each row through a Gated DeltaNet layer between its projections, in float64: mixed [B, C +
    Hv Dv + 2 Hv], tail [B, C, K - 1], state [B, Hv, Dk, Dv], conv [C, K] -> (o [B, Hv Dv], new tail, new state)."""
    b, c, hv, dv = mixed.shape[0], tail.shape[1], state.shape[1], state.shape[3]
    qkv, z, beta, a = mixed.double().split([c, hv * dv, hv, hv], -1)
    window = torch.cat([tail.double(), qkv[..., None]], -1)
    q, k, v = F.silu((window * conv.double()).sum(-1)).split([key_heads * key_dim, key_heads * key_dim, hv * dv], -1)

    def unit(x):
        x = x.view(b, key_heads, key_dim)
        return (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(hv // key_heads, 1)

    q, k, v = unit(q) * key_dim ** -0.5, unit(k), v.view(b, hv, dv)
    g = neg_rate.double() * F.softplus(a + dt_bias.double())
    s = state.double() * g.exp()[..., None, None]
    u = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.sigmoid()[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    o = o / (o.pow(2).mean(-1, keepdim=True) + eps).sqrt() * norm.double() * F.silu(z.view(b, hv, dv))
    return o.reshape(b, -1), window[..., 1:], s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_decode_equals_the_layer_in_float64_and_its_eager_roundings(dtype):
    """Three decode steps of three sequences on scattered state slots through gated_delta_decode (GatedDeltaNet's
    decodes): outputs, convolution tails and states against the layer's arithmetic in float64 (float32), or against
    its PyTorch operations, whose roundings the kernel mirrors (bfloat16); slots no sequence holds stay as they were.
    2 key heads of 32 serve 4 value heads of 24 (each value head must read its own key head), kernel 4."""
    from llmq.runtime.kv_cache import LayerRecurrent
    from llmq.runtime.models.linear_attention import GatedDeltaNet

    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(21)
    kh, hv, dk, dv, kernel, eps = 2, 4, 32, 24, 4, 1e-6
    channels = 2 * kh * dk + hv * dv
    conv = torch.randn(channels, 1, kernel, generator=gen) * 0.5
    a_log, dt_bias, norm = torch.rand(hv, generator=gen), torch.randn(hv, generator=gen), torch.rand(dv, generator=gen)
    layer = GatedDeltaNet(None, None, conv.to(dtype), a_log, dt_bias, (norm + 0.5).to(dtype), eps, kh, hv, dk, dv)
    cache, eager = (LayerRecurrent(6, channels, kernel, hv, dk, dv, dtype, "cpu") for _ in range(2))
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.3)
    eager.conv.copy_(cache.conv), eager.state.copy_(cache.state)
    tail, state = cache.conv.double(), cache.state.double()
    slots = torch.tensor([4, 1, 3])
    for _ in range(3):
        mixed = torch.randn(3, channels + hv * dv + 2 * hv, generator=gen).to(dtype)
        got = layer._decodes(mixed, cache, slots, None, None)
        if dtype == torch.float32:
            want, tail[slots], state[slots] = _gated_delta_reference(mixed, tail[slots], state[slots], layer.conv,
                                                                     layer.neg_rate, layer.dt_bias, layer.norm, eps,
                                                                     kh, dk)
            tol = 1e-5
        else:
            b, a = mixed[:, -2 * hv:-hv].float(), mixed[:, -hv:].float()
            with mock.patch.object(cpu_kernels, "usable", lambda t: False):
                want = layer._decodes(mixed, eager, slots, layer.neg_rate * F.softplus(a + layer.dt_bias),
                                      b.sigmoid())
            tail, state, tol = eager.conv.double(), eager.state.double(), 2e-2
        assert got.dtype == dtype
        assert got.shape == (3, hv * dv)
        assert float((got.double() - want.double()).abs().max()) <= tol * float(want.abs().max())
    assert float((cache.state.double() - state).abs().max()) <= 1e-5 * float(state.abs().max())
    assert torch.equal(cache.conv.double(), tail)   # the tails are moved, not computed
    assert torch.equal(cache.state[[0, 2, 5]].double(), state[[0, 2, 5]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fresh", [False, True])
def test_delta_prefill_equals_the_chunked_rule(dtype, fresh):
    """A 150-token prefill chunk of one sequence through delta_prefill (token by token, on the slot in place) against
    GatedDeltaNet's chunked rule in PyTorch (delta_rule.chunked, itself held to a float64 recurrence in
    tests/test_hybrid.py), from the slot's state or from zeros: outputs, the slot's tail and state; the other slots
    untouched. 2 key heads of 32 serve 4 value heads of 24; rows with the mix projection's stride."""
    from llmq.runtime.kv_cache import LayerRecurrent
    from llmq.runtime.models.linear_attention import GatedDeltaNet

    gen = torch.Generator().manual_seed(23)
    kh, hv, dk, dv, kernel, n = 2, 4, 32, 24, 4, 150
    channels = 2 * kh * dk + hv * dv
    layer = GatedDeltaNet(None, None, (torch.randn(channels, 1, kernel, generator=gen) * 0.5).to(dtype),
                          torch.rand(hv, generator=gen), torch.randn(hv, generator=gen),
                          torch.rand(dv, generator=gen).to(dtype), 1e-6, kh, hv, dk, dv)
    cache, eager = (LayerRecurrent(4, channels, kernel, hv, dk, dv, dtype, "cpu") for _ in range(2))
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.3)
    eager.conv.copy_(cache.conv), eager.state.copy_(cache.state)
    rows = torch.randn(n, channels + 7, generator=gen).to(dtype)[:, :channels]   # a strided view, as the mix's
    g, beta = -torch.rand(n, hv, generator=gen) * 2, torch.rand(n, hv, generator=gen)
    got = layer._chunk(cache, 2, rows, g, beta, fresh)
    with mock.patch.object(cpu_kernels, "usable", lambda t: False):
        want = layer._chunk(eager, 2, rows, g, beta, fresh)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    assert float((cache.state - eager.state).abs().max()) <= tol * float(eager.state.abs().max())
    assert torch.equal(cache.conv, eager.conv)
    assert torch.equal(cache.state[[0, 1, 3]], eager.state[[0, 1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotated", [64, 16])
def test_rope_kv_write_equals_eager(dtype, rotated):
    """Heads of 64 turned whole, or their first 16 only (a partial rotary embedding: Qwen3.5's quarter)."""
    gen = torch.Generator().manual_seed(13)
    fused, eager = _cache(dtype, gen, layers=2)
    eager.k.copy_(fused.k), eager.v.copy_(fused.v)
    rot = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, rotated, 2).float() / rotated), 128, dtype=dtype)
    positions = torch.tensor([3, 9, 17, 40, 41])
    qkv = torch.randn(5, 15 * 64, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 77, 100, 3, 250]))
    got = rotate_and_store(qkv, rot.table(positions), fused, meta, 9, 3)
    with mock.patch.object(cpu_kernels, "usable", lambda t: False):
        want = rotate_and_store(qkv, rot.table(positions), eager, meta, 9, 3)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert float((g.float() - w.float()).abs().max()) <= 1e-6 * float(w.abs().max())
    assert float((fused.k.float() - eager.k.float()).abs().max()) <= 1e-6 * float(eager.k.abs().max())
    assert torch.equal(fused.v, eager.v)
    assert not torch.equal(fused.k[0, 5], qkv[0, 9 * 64:12 * 64].view(3, 64))  # k was stored rotated


def test_rope_kv_write_refuses_a_slot_outside_the_cache():
    gen = torch.Generator().manual_seed(17)
    (cache,) = _cache(torch.float32, gen)
    rot = RotaryEmbedding(torch.ones(32), 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.rope_kv_write(torch.zeros(1, 15 * 64), *rot.table(torch.tensor([0])), cache.k, cache.v,
                                  torch.tensor([24 * 16]), 9, 3)


def _step_logits(model_dir, prompts, **config):
    """Every step's logits (prefill and decode) of a greedy run."""
    from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(model_dir, EngineConfig(max_num_batched_tokens=64, block_size=8, **config))
    logits, execute = [], eng.runner.execute
    eng.runner.execute = lambda step: logits.append(execute(step).clone()) or logits[-1]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return [o.output_token_ids for o in outs], logits


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_avx512)])
def test_model_steps_with_kernels_equal_eager(tmp_path, make_tiny_model, dtype):
    """A float32 / bfloat16 model's decode and prefill steps through the kernels (norm, rotary + cache write, decode
    attention; the bfloat16 one's projections on dense16_linear, its decodes in a DecoderStack) against the same
    engine on PyTorch's operations."""
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(tmp_path / "m", seed=5)
    AutoModelForCausalLM.from_pretrained(d, dtype=dtype).save_pretrained(d)
    prompts = [[(7 * i + 3) % 256 for i in range(n)] for n in (9, 30, 2)]
    real, stacked = layer_stack.run_stack, []
    with mock.patch.object(layer_stack, "run_stack", lambda *a: stacked.append(1) or real(*a)):
        tokens, got = _step_logits(d, prompts)
    assert bool(stacked) == (dtype == torch.bfloat16)
    with mock.patch.object(cpu_kernels, "usable", lambda t: False):
        want_tokens, want = _step_logits(d, prompts)
    assert tokens == want_tokens
    assert len(got) == len(want) >= 10
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) < 1e-4 * float(w.abs().max())


@needs_avx512
def test_the_kv_budget_counts_16bit_weights_as_the_engine_holds_them(tmp_path, make_tiny_model):
    """runtime_bytes with the runtime's keeps_as_stored: a bfloat16 model served in float32 holds its 2-D weights at 2
    bytes (on dense16_linear), so the estimate the KV budget subtracts is what the engine holds, not twice it."""
    import functools

    from transformers import AutoModelForCausalLM

    from llmq.models.reader import CheckpointReader
    from llmq.runtime import EngineConfig, LLMEngine
    from llmq.runtime.layers.linear import keeps_as_stored

    d = make_tiny_model(tmp_path / "m", seed=7, tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(d)
    eng = LLMEngine(d, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    model = eng.runner.model
    held = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if not n.startswith("rotary.") and t.data_ptr() != model.embed.data_ptr()) + model.embed.nbytes
    eng.shutdown()
    ckpt = CheckpointReader(d)
    kept = functools.partial(keeps_as_stored, dtype=torch.float32, device="cpu")
    assert held <= ckpt.runtime_bytes(torch.float32, kept) < 1.1 * held < ckpt.runtime_bytes(torch.float32)


@needs_avx512
def test_a_tied_16bit_table_is_one_tensor(tmp_path, make_tiny_model):
    """A tied bfloat16 embedding stays as stored and the lm_head computes from that same memory (no float32 copy)."""
    from transformers import AutoModelForCausalLM

    from llmq.runtime import EngineConfig, LLMEngine

    d = make_tiny_model(tmp_path / "m", seed=6, tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(d)
    eng = LLMEngine(d, EngineConfig(max_model_len=64))
    model = eng.runner.model
    assert model.embed.dtype == torch.bfloat16
    assert model.lm_head.dense16
    assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()
    eng.shutdown()


@pytest.mark.parametrize("bits,int8_activations", [(4, False), (8, False), pytest.param(5, False, marks=needs_avx2),
                                                   pytest.param(4, True, marks=needs_vnni),
                                                   pytest.param(8, True, marks=needs_vnni),
                                                   pytest.param(16, False, marks=needs_avx512),
                                                   pytest.param("nvfp4", False, marks=needs_avx2),
                                                   pytest.param("mxfp4", False, marks=needs_avx2),
                                                   pytest.param("q4_k", False, marks=needs_avx2),
                                                   pytest.param("fp8_block", False, marks=needs_fp8),
                                                   pytest.param("iq4_xs", False, marks=needs_avx2),
                                                   pytest.param("bnb-nf4", False, marks=needs_avx2)])
@pytest.mark.parametrize("fused_layers", ["all", "odd"])
def test_decoder_stacks_equal_op_by_op(tmp_path, make_tiny_model, bits, int8_activations, fused_layers):
    """An INT4 / INT5 / INT8 / bfloat16 / FP4 / Q4_K / block-FP8 / IQ4_XS / NF4 model's decode steps through
    cpu_kernels' DecoderStacks (every layer in one stack, or runs of one fused layer between layers run op by op)
    against the same layers all run op by op (the same kernels, so equal up to float32 rounding). Block FP8's q / k / v
    end inside a 128-row block, so the stack takes them joined (BlockFP8Linear.joined)."""
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    wide = dict(hidden_size=256, intermediate_size=256)   # GGML grids: 256 inputs; block FP8: k / v 64 rows, q 256
    grid = bits in ("q4_k", "iq4_xs")
    d = make_tiny_model(tmp_path / "m", seed=9, **(wide if grid else dict(wide, num_key_value_heads=1)
                                                    if bits == "fp8_block" else {}))
    if bits in (5, 16):   # INT5's kernel takes the bfloat16 scales of a bfloat16 model
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(d)
    src = resolve_model(str(d), store)
    options = dict(method="rtn", bits=4, grid=bits) if grid else \
        dict(method="fp8", group_size=quant.FP8_BLOCK) if bits == "fp8_block" else dict(method=bits) \
        if isinstance(bits, str) else dict(method="rtn", bits=bits, group_size=0 if bits == 8 else 32)
    art = src if bits == 16 else quantize(src, QuantizeOptions(**options, num_samples=2, seq_len=32, probe_tokens=64),
                                          store, progress=False)
    prompts = [[(5 * i + 1) % 256 for i in range(n)] for n in (12, 3)]
    layer_args, built, stacked = layer_stack.fused_layer_args, [], []

    def some_layers(layer):  # "odd": layers 1, 3, ... fused, so the runs alternate
        built.append(layer)
        return layer_args(layer) if fused_layers == "all" or len(built) % 2 == 0 else None

    real = layer_stack.run_stack
    with mock.patch.object(layer_stack, "fused_layer_args", some_layers), \
            mock.patch.object(layer_stack, "run_stack", lambda stack, x, rope, caches, *a:
                              stacked.append(len(caches)) or real(stack, x, rope, caches, *a)):
        tokens, fused = _step_logits(art.path, prompts, int8_activations=int8_activations)
    n = len(built)
    assert n >= 2
    assert stacked
    assert set(stacked) == ({n} if fused_layers == "all" else {1})
    with mock.patch.object(layer_stack, "fused_layer_args", lambda layer: None):
        op_tokens, op_by_op = _step_logits(art.path, prompts, int8_activations=int8_activations)
    assert tokens == op_tokens
    for g, w in zip(fused, op_by_op):
        assert float((g - w).abs().max()) < 1e-4 * float(w.abs().max())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_qk_norm_and_gated_deltanet_layers_decode_in_one_stack(tmp_path, make_tiny_model, family):
    """A Qwen3 (q / k norms) and a Qwen3.5 hybrid (three Gated DeltaNet layers, then attention with q / k norms, an
    output gate and a rotary embedding over a quarter of each head), bfloat16 weights in INT4: every decode step runs
    the four layers in one DecoderStack, equal to the layers op by op (the same kernels: a wrong slot, norm or gate
    would be far off)."""
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    cfg = dict(model_type=family, num_hidden_layers=4, hidden_size=128, intermediate_size=256, head_dim=32)
    if family == "qwen3_5_text":
        cfg |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
    d = make_tiny_model(tmp_path / "m", seed=9, **cfg)
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(d)   # 16-bit kept tensors
    art = quantize(resolve_model(str(d), store), QuantizeOptions(method="rtn", bits=4, group_size=32, num_samples=2,
                                                                   seq_len=32, probe_tokens=0), store, progress=False)
    prompts = [[(5 * i + 1) % 256 for i in range(n)] for n in (12, 3)]
    real, stacked = layer_stack.run_stack, []
    with mock.patch.object(layer_stack, "run_stack", lambda stack, x, rope, caches, *a:
                           stacked.append(len(caches)) or real(stack, x, rope, caches, *a)):
        tokens, fused = _step_logits(art.path, prompts)
    assert set(stacked) == {4}
    with mock.patch.object(layer_stack, "fused_layer_args", lambda layer: None):
        op_tokens, op_by_op = _step_logits(art.path, prompts)
    assert tokens == op_tokens
    for g, w in zip(fused, op_by_op):
        assert float((g - w).abs().max()) < 1e-4 * float(w.abs().max())


def test_nope_layers_decode_in_a_stack_of_their_own(tmp_path, make_tiny_model):
    """A SmolLM3 whose last layer attends without the rotary embedding, in INT4: decode steps run layers 0-2 in one
    DecoderStack and the NoPE layer in another (one rotary table a stack), equal to every layer op by op."""
    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    src = resolve_model(str(make_tiny_model(tmp_path / "m", seed=9, model_type="smollm3", num_hidden_layers=4)), store)
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, num_samples=2, seq_len=32,
                                        probe_tokens=0), store, progress=False)
    prompts = [[(5 * i + 1) % 256 for i in range(n)] for n in (12, 3)]
    real, stacked = layer_stack.run_stack, []
    with mock.patch.object(layer_stack, "run_stack", lambda stack, x, rope, caches, *a:
                           stacked.append((len(caches), bool(rope[1].any()))) or real(stack, x, rope, caches, *a)):
        tokens, fused = _step_logits(art.path, prompts)
    assert set(stacked) == {(3, True), (1, False)}   # the NoPE layer's stack gets sin = 0
    with mock.patch.object(layer_stack, "fused_layer_args", lambda layer: None):
        op_tokens, op_by_op = _step_logits(art.path, prompts)
    assert tokens == op_tokens
    for g, w in zip(fused, op_by_op):
        assert float((g - w).abs().max()) < 1e-4 * float(w.abs().max())


@pytest.mark.parametrize("bits", [pytest.param(4, marks=needs_avx2), pytest.param(5, marks=needs_avx2),
                                  pytest.param(8, marks=needs_avx512)])
def test_model_on_lowbit_linear_bf16_equals_pytorchs_kernels(tmp_path, make_tiny_model, bits):
    """A bfloat16 model's INT4 / INT5 / INT8 artifact (bfloat16 scales, as the default model's): prefill and decode
    steps on llmq's 16-bit-activation kernels against PyTorch's (INT5, which PyTorch has no kernel for: against the
    float path's product of the dequantized weight, its input and output rounded to bfloat16 as the kernel's are): the
    logits agree to bfloat16 rounding (a float32 summation order apart)."""
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    d = make_tiny_model(tmp_path / "m", seed=4)
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(d)
    src = resolve_model(str(d), store)
    art = quantize(src, QuantizeOptions(method="rtn", bits=bits, group_size=0 if bits == 8 else 32, num_samples=2,
                                        seq_len=32, probe_tokens=64), store, progress=False)
    prompts = [[(3 * i + 2) % 256 for i in range(n)] for n in (14, 5)]
    from llmq.runtime.layers import linear

    real, kinds = linear._lowbit, []
    with mock.patch.object(linear, "_lowbit", lambda *a: kinds.append(real(*a)) or kinds[-1]):
        tokens, ours = _step_logits(art.path, prompts)
    assert kinds
    assert all(k and k[0] == bits and not k[2] for k in kinds)  # every layer on llmq's kernel
    fits = cpu_kernels.lowbit_fits
    rounded = SimpleNamespace(linear=lambda x, w, *bias: F.linear(x, w, *bias) if bias else  # a DenseLinear's: as is
                              F.linear(x.bfloat16().float(), w).bfloat16().float())
    with mock.patch.object(cpu_kernels, "lowbit_fits", lambda n, k, g, bits, a8: a8 and fits(n, k, g, bits, a8)), \
            mock.patch.object(linear, "F", rounded if bits == 5 else F):
        theirs_tokens, theirs = _step_logits(art.path, prompts)
    assert len(ours) == len(theirs) == 10
    assert all(g.shape[0] == 2 for g in ours)   # step j: token j of both
    compared = 0
    for j, (g, w) in enumerate(zip(ours, theirs)):
        for r in range(2):   # while the two greedy runs fed the same tokens (a near tie may flip one in bfloat16)
            if tokens[r][:j] == theirs_tokens[r][:j]:
                assert float((g[r] - w[r]).abs().max()) < 1e-2 * float(w[r].abs().max()), (j, r)
                compared += 1
    assert compared >= 10


@needs_vnni
def test_int8_activations_move_the_logits_a_little(tmp_path, make_tiny_model):
    """On the same inputs (a prompt) int8 activations change an INT4 model's distribution, by a little."""
    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    src = resolve_model(str(make_tiny_model(tmp_path / "m", seed=9)), store)
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, num_samples=2, seq_len=32,
                                        probe_tokens=64), store, progress=False)
    prompt = [[(5 * i + 1) % 256 for i in range(20)]]
    (_, (a8, *_)), (_, (default, *_)) = (_step_logits(art.path, prompt, int8_activations=x) for x in (True, False))
    p, q = default.log_softmax(-1), a8.log_softmax(-1)
    assert 1e-7 < float((p.exp() * (p - q)).sum(-1).max()) < 1e-3


def test_a_failed_build_is_one_warning_and_the_eager_path(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def broken(**kw):
        raise RuntimeError("Error building extension 'llmq_cpu_kernels'\ncpu_kernels.cpp:1:1: error: no compiler here")

    monkeypatch.setattr(ext, "load", broken)
    assert cpu_kernels._build() is False
    assert "error: no compiler here" in caplog.text
    assert "using PyTorch's operations" in caplog.text


def test_a_build_still_running_elsewhere_is_a_bounded_wait_and_the_eager_path(tmp_path, monkeypatch, caplog):
    """Another process holding the build's lock (a build in progress, or hung) costs a bounded wait, then one
    warning and PyTorch's operations: never the wait for ever that a killed build's lock file used to cause."""
    import fcntl
    from pathlib import Path

    from llmq.runtime.layers import cpp_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpp_build.build_directory("llmq_cpu_kernels", Path(cpu_kernels.__file__).with_suffix(".cpp"),
                                          ["-O3", "-fopenmp"])
    directory.mkdir(parents=True)
    with open(directory / "llmq.lock", "a") as held:  # a second open file: flock conflicts within one process too
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cpu_kernels._build(wait=0.5) is False
    assert "another process has been building" in caplog.text
    assert "using PyTorch's operations" in caplog.text
