"""The runtime's quantized linear layers and quantized KV cache against float64 references on fresh random data."""

from __future__ import annotations

import pytest
import torch

from llmq.runtime.kv_cache import allocate_kv_cache
from llmq.runtime.layers.act_quant import FP8Linear, W8A8Linear
from llmq.runtime.layers.linear import DenseLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def int_weights(n, k, bits, group, asym, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    groups = k // group
    wg = w.view(n, groups, group)
    qmax = 2 ** (bits - 1) - 1
    if asym:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo) / (2 ** bits - 1)
        zero = (-(2 ** (bits - 1)) - lo / scale).round()
    else:
        scale = wg.abs().amax(-1) / qmax
        zero = None
    zq = zero.unsqueeze(-1) if zero is not None else 0
    q = (wg / scale.unsqueeze(-1) + zq).round().clamp(-qmax - 1, qmax).to(torch.int8).view(n, k)
    ref = ((q.view(n, groups, group).double() - zq) * scale.unsqueeze(-1).double()).view(n, k)
    return q, scale, zero, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_dense_linear_is_prepacked_where_the_cpu_computes_its_dtype(dtype, rows):
    """float32 weights are always prepacked for oneDNN; bfloat16 ones where the CPU has native bfloat16 (then
    `--dtype bfloat16` reads half the bytes). Either way the layer computes the linear of its dtype."""
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(rows, 64, generator=g)
    layer = DenseLinear(w.to(dtype), b.to(dtype))
    native = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (layer.packed is not None) == native
    assert layer.nbytes == 96 * 64 * dtype.itemsize + 96 * dtype.itemsize
    got = layer(x.to(dtype))
    ref = x.to(dtype).double() @ w.to(dtype).double().t() + b.to(dtype).double()
    assert got.dtype == dtype
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_int8_weight_only_matches_dequantized(rows):
    q, scale, _, ref_w = int_weights(96, 64, 8, 64, False, seed=rows)
    bias = torch.randn(96)
    layer = Int8WeightOnlyLinear(q, scale.view(-1), None, bias, torch.float32)
    assert layer.kernel  # the packed int8 kernel is used for small batches on this build
    x = torch.randn(rows, 64)
    ref = x.double() @ ref_w.t() + bias.double()
    assert rel_err(layer(x), ref) < 1e-2  # bf16 activations in the CPU kernel; a wrong scale/layout is O(1)
    grouped = Int8WeightOnlyLinear(*int_weights(96, 64, 8, 16, True, seed=5)[:3], None, torch.float32)
    _, _, _, gref = int_weights(96, 64, 8, 16, True, seed=5)
    assert not grouped.kernel
    assert rel_err(grouped(x), x.double() @ gref.t()) < 1e-5


@pytest.mark.parametrize("cls", [Int8WeightOnlyLinear, W8A8Linear])
def test_int8_kernels_take_weights_at_any_address(cls):
    """A weight whose data is not 32-byte aligned (as safetensors can hand one out) used to crash the int8 kernel."""
    q, scale, _, _ = int_weights(64, 64, 8, 64, False, seed=9)
    buf = torch.empty(q.numel() + 64, dtype=torch.int8)
    offset = (8 - buf.data_ptr()) % 64  # start 8 bytes past a 64-byte boundary
    shifted = buf[offset:offset + q.numel()].view_as(q)
    shifted.copy_(q)
    assert shifted.data_ptr() % 64 == 8
    x = torch.randn(5, 64)  # 4 to 8 rows: the kernel path, on its blocked loop that needs aligned weights
    got = cls(shifted, scale.view(-1), None, None, torch.float32)(x)
    assert torch.equal(got, cls(q.clone(), scale.view(-1), None, None, torch.float32)(x))


@pytest.mark.parametrize("n,group,asym", [(64, 32, False), (48, 64, True), (40, 32, False)])
@pytest.mark.parametrize("rows", [1, 40])
def test_int4_weight_only_matches_dequantized(n, group, asym, rows):
    q, scale, zero, ref_w = int_weights(n, 128, 4, group, asym, seed=n + rows)
    layer = Int4WeightOnlyLinear(q, scale, zero, None, torch.float32)
    assert bool(layer.packed) == (n % 16 == 0)  # the CPU tinygemm kernel needs N % 16 == 0; else dequantize
    if layer.packed:
        assert layer.w_packed.numel() * layer.w_packed.element_size() == n * 128 // 2  # really 4 bits a weight
    x = torch.randn(rows, 128)
    assert rel_err(layer(x), x.double() @ ref_w.t()) < 1e-2


@pytest.mark.parametrize("n,group,asym", [(64, 32, False), (96, 64, True), (48, 32, False)])
def test_int4_prefill_on_the_blas_computes_the_kernels_numbers(n, group, asym, monkeypatch):
    """From 128 rows the CPU int4 layer multiplies the weight it dequantizes from PyTorch's packing on the BLAS: the
    dequantized weight is bit for bit what the kernel multiplies by (the kernel on the identity returns it rounded to
    bfloat16), and a prefill gives the chunked kernel's outputs up to summation order. PyTorch packs blocks of 64
    channels where its CPU build runs AVX-512, else 32; a packing it cannot read (N not a multiple) keeps the kernel."""
    q, scale, zero, ref_w = int_weights(n, 128, 4, group, asym, seed=n)
    layer = Int4WeightOnlyLinear(q, scale, zero, None, torch.float32)
    assert layer.packed
    block = 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32
    assert layer.unpacks == (block if n % block == 0 else 0)
    x = torch.randn(layer.blas_rows + 72, 128)
    chunked = torch.cat([layer._kernel(c) for c in x.split(layer.max_kernel_rows)]).float()
    calls, kernel = [], layer._kernel
    monkeypatch.setattr(layer, "_kernel", lambda c: (calls.append(len(c)), kernel(c))[1])
    got = layer(x)
    assert calls == ([] if layer.unpacks else [32] * 6 + [8])
    assert rel_err(got, chunked) < 2e-3                          # bfloat16 outputs; a wrong nibble is O(1e-1)
    assert rel_err(got, x.double() @ ref_w.t()) < 1e-2
    if layer.unpacks:
        monkeypatch.undo()
        eye = layer._kernel(torch.eye(128))                      # [K, N]: row i is input i's weights, in bfloat16
        assert torch.equal(layer._dequantized_t().bfloat16(), eye)


@pytest.mark.parametrize("cls,op", [(Int4WeightOnlyLinear, "_weight_int4pack_mm_for_cpu"),
                                    (Int8WeightOnlyLinear, "_weight_int8pack_mm")])
def test_packed_kernels_get_contiguous_activations(cls, op, monkeypatch):
    """The CUDA int4 kernel raises on strided activations, as the MLP hands down_proj (the gate half of gate_up,
    found on the first GPU run); the CPU kernels accept them, so the contract is checked at the call."""
    q, scale, zero, ref_w = int_weights(64, 128, 4 if cls is Int4WeightOnlyLinear else 8, 32 if cls is
                                        Int4WeightOnlyLinear else 128, False, seed=11)
    layer = cls(q, scale if cls is Int4WeightOnlyLinear else scale.view(-1), zero, None, torch.float32)
    real, seen = getattr(torch.ops.aten, op), []
    monkeypatch.setattr(torch.ops.aten, op, lambda x, *a: (seen.append(x.is_contiguous()), real(x, *a))[1])
    x = torch.randn(3, 256)[:, ::2]  # every other column: a strided view
    assert not x.is_contiguous()
    assert rel_err(layer(x), x.double() @ ref_w.t()) < 1e-2
    assert seen == [True]


def test_cuda_int4_packing_tiles_cover_every_k_multiple_of_32():
    """The CUDA tinygemm layout takes 2, 4 or 8 k-tiles of 16 per load; requiring 8 (K % 128) had sent SmolLM2's
    K = 576 to the slow dequantize path on GPUs."""
    from llmq.runtime.layers.linear import cuda_inner_k_tiles

    assert [cuda_inner_k_tiles(k) for k in (576, 1536, 4096, 14336, 96, 64, 48)] == [4, 8, 8, 8, 2, 4, None]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 24])
def test_w8a8_quantizes_activations_per_token(static, rows):
    q, scale, _, ref_w = int_weights(64, 96, 8, 96, False, seed=7)
    x = torch.randn(rows, 96) * torch.linspace(0.1, 3, rows).unsqueeze(1)
    input_scale = (x.abs().max() / 127).reshape(1) if static else None
    layer = W8A8Linear(q, scale.view(-1), input_scale, None, torch.float32)
    s = input_scale.double() if static else x.double().abs().amax(-1, keepdim=True) / 127
    xq = (x.double() / s).round().clamp(-128, 127) * s
    ref = xq @ ref_w.t()
    assert rel_err(layer(x), ref) < 8e-3
    # activation quantization really happens: the float-activation product differs by more than that
    assert rel_err(x.double() @ ref_w.t(), ref) > 1e-3 or static


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_matches_dequantized(act_quant):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g)
    scale = w.abs().amax(-1) / 448
    wq = (w / scale[:, None]).to(torch.float8_e4m3fn)
    layer = FP8Linear(wq, scale, None, act_quant, None, torch.float32)
    x = torch.randn(5, 64)
    ref_w = wq.double() * scale[:, None].double()
    xs = x.double()
    if act_quant:
        s = x.abs().amax(-1, keepdim=True) / 448
        xs = (x / s).to(torch.float8_e4m3fn).double() * s.double()
    assert rel_err(layer(x), xs @ ref_w.t()) < 1e-5


@pytest.mark.parametrize("kv_dtype,tol", [("int8", 0.01), ("fp8", 0.07)])
def test_quantized_kv_cache_round_trips_within_its_precision(kv_dtype, tol):
    qmax = 127 if kv_dtype == "int8" else 448
    k = torch.randn(10, 2, 8) * 3
    v = torch.randn(10, 2, 8) * torch.tensor([1.0, 20.0]).view(1, 2, 1)
    scales = [(k.abs().amax() / qmax, v.abs().amax(dim=(0, 2)) / qmax)]  # per-tensor K, per-head V
    (layer,) = allocate_kv_cache([(2, 8)], 4, 4, kv_dtype, torch.float32, "cpu", scales)
    assert layer.k.dtype in (torch.int8, torch.uint8)
    assert layer.k.element_size() == 1
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 12, 13])  # blocks 0, 1 and the start of block 3
    layer.write(slots, k, v)
    kg, vg = layer.gather(torch.tensor([[0, 1, 3]]))
    assert float((kg[0, :10] - k).abs().max() / k.abs().max()) < tol
    for h in range(2):  # each head within its own scale's precision
        assert float((vg[0, :10, h] - v[:, h]).abs().max() / v[:, h].abs().max()) < tol
