"""NVFP4 and MXFP4 weights: the arithmetic against an independent float64 reference, the compressed-tensors checkpoint
against compressed-tensors' own decompressor, the runtime against a float64 dequantize-then-matmul model, the GGUF
export against gguf-py's dequantizer.

The reference below is written from the formats' definitions (the OCP MX spec, compressed-tensors' NVFP4 scale
rules), by enumeration in NumPy float64, sharing nothing with `llmq.quant`. Inputs are fresh random numbers each run
(the seed is in every failure message).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import llmq_logits, make_tiny_model

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import qformat
from llmq.models.reader import CheckpointReader

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3 = np.array([(c & 7) / 8 * 2.0 ** -6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
                 for c in range(127)])  # every non-negative finite E4M3 value, from its bit fields
SEED = int.from_bytes(os.urandom(4), "little")


def _nearest_ref(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value by brute force; among equally near ones the even index."""
    d = np.abs(x.reshape(-1, 1) - grid.reshape(1, -1))
    best = d == d.min(1, keepdims=True)
    idx = np.where(best.sum(1) > 1, np.argmax(best & (np.arange(len(grid)) % 2 == 0), 1), np.argmax(best, 1))
    return idx.reshape(x.shape)


def _codes_ref(x: np.ndarray) -> np.ndarray:
    return _nearest_ref(np.abs(x), E2M1) + 8 * (x < 0)


def _values_ref(codes: np.ndarray) -> np.ndarray:
    return E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)


def _weight(n=24, k=128, gen=None):
    """A random weight with a spread of block magnitudes (so scales range over many exponents) and exact zeros."""
    gen = gen or np.random.default_rng(SEED)
    w = gen.standard_normal((n, k)) * np.exp2(gen.integers(-12, 4, (n, k // 16))).repeat(16, 1)
    w[gen.random((n, k)) < 0.02] = 0.0
    w[0, :16] = 0.0  # an all-zero block
    return torch.from_numpy(w.astype(np.float32))


def test_e2m1_rounding_is_nearest_half_to_even_and_saturates():
    x = np.random.default_rng(SEED).uniform(-8, 8, 20000)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -5.0, 6.5, -100.0, -0.0, -1e-9])
    x = np.concatenate([x, ties])
    got = quant.e2m1_codes(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _codes_ref(x), err_msg=f"seed {SEED}")
    # the ties, spelled out: each goes to the even code (the even mantissa), as compressed-tensors rounds
    assert _values_ref(got[-14:]).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -4.0, 6.0, -6.0,
                                               0.0, -0.0]
    assert got[-1] == 8
    assert got[-2] == 0   # -1e-9 keeps its sign (code 8, "-0"); -0.0 is +0 as packed
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x32 = torch.from_numpy(x.astype(np.float32))  # the same values for both: a float64 value a hair off a tie is one
    np.testing.assert_array_equal(quant.e2m1_values(quant.e2m1_codes(x32)).numpy(),  # in float32 (seed 355)
                                  cast_to_fp4(x32).numpy(), err_msg=f"seed {SEED}")


def test_e4m3_rounding_from_float64_is_one_rounding():
    gen = np.random.default_rng(SEED)
    x = np.concatenate([np.exp2(gen.uniform(-12, 9.5, 20000)), (E4M3[1:] + E4M3[:-1]) / 2, [0.0, 1e-6, 500.0]])
    got = quant.round_e4m3(torch.from_numpy(x)).float().double().numpy()
    np.testing.assert_array_equal(got, E4M3[_nearest_ref(x, E4M3)], err_msg=f"seed {SEED}")
    assert got[-1] == 448.0   # saturates


def test_pack_is_compressed_tensors_nibble_order():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    codes = torch.from_numpy(np.random.default_rng(SEED).integers(0, 16, (8, 64)).astype(np.uint8))
    codes[codes == 8] = 0   # compressed-tensors' packer takes values; -0.0 and 0.0 are one value to it
    packed = quant.pack_fp4(codes)
    assert packed.dtype == torch.uint8
    assert packed.shape == (8, 32)
    assert torch.equal(packed, pack_fp4_to_uint8(quant.e2m1_values(codes)))
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))   # the first code in the low nibble
    assert torch.equal(quant.unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4_from_uint8(packed, 8, 64, torch.float32), quant.e2m1_values(codes))


def test_nvfp4_matches_the_float64_reference():
    w = _weight()
    codes, scale, g = quant.nvfp4_quantize(w)
    wd = w.double().numpy()
    # the stored global scale: 2688 / amax as compressed-tensors' generate_gparam computes it, a number over a float32
    # tensor, which PyTorch evaluates as the tensor's float32 reciprocal times the number
    g_ref = (np.float32(1.0) / np.float32(np.abs(wd).max())) * np.float32(2688.0)
    assert g.dtype == torch.float32, f"seed {SEED}"
    assert g.shape == (1,), f"seed {SEED}"
    assert g.item() == g_ref, f"seed {SEED}"
    blocks = wd.reshape(w.shape[0], -1, 16)
    s_ref = E4M3[_nearest_ref(np.abs(blocks).max(-1) * np.float64(g_ref) / 6, E4M3)]
    assert scale.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(scale.double().numpy(), s_ref, err_msg=f"seed {SEED}")
    step = (s_ref.astype(np.float32) / g_ref).astype(np.float32)   # compressed-tensors: scale / global, in float32
    with np.errstate(divide="ignore", invalid="ignore"):
        q_ref = _codes_ref(np.nan_to_num(blocks / step.astype(np.float64)[..., None])).reshape(w.shape)
    np.testing.assert_array_equal(codes.numpy(), q_ref, err_msg=f"seed {SEED}")
    deq = (_values_ref(q_ref).reshape(blocks.shape).astype(np.float32) * step[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(quant.dequantize_fp4(codes, scale, g).numpy(), deq, err_msg=f"seed {SEED}")


def test_nvfp4_global_scale_divides_as_compressed_tensors_reads_it():
    """weight_global_scale = 2688 / amax is a divisor: real = q * (scale / global). So the block holding the tensor's
    largest magnitude gets the largest E4M3 scale (448) and that magnitude comes back; compressed-tensors' own
    dequantize agrees value for value. (ModelOpt's weight_scale_2 is the reciprocal, amax / 2688, a multiplier.)"""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = _weight()
    codes, scale, g = quant.nvfp4_quantize(w)
    amax = w.abs().max()
    assert g.item() == pytest.approx(2688 / amax.item(), rel=1e-7)
    assert scale.float().max().item() == 448.0
    back = quant.dequantize_fp4(codes, scale, g)
    assert back.abs().max().item() == pytest.approx(amax.item(), rel=2 ** -22)
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            scale_dtype=torch.float8_e4m3fn)
    ct = dequantize(quant.e2m1_values(codes), scale.float(), args=args, global_scale=g, dtype=torch.float32)
    assert torch.equal(ct, back)
    assert not torch.equal(quant.dequantize_fp4(codes, scale, 1 / g), back)   # a multiplier would be another weight


def test_mxfp4_matches_the_ocp_rule_and_the_float64_reference():
    w = _weight(k=256)
    w[1, 32:64] = torch.linspace(-7.5, 7.5, 32)   # amax 7.5: scale 2^(2 - 2) = 1, so 7.5 saturates to 6
    codes, e = quant.mxfp4_quantize(w)
    assert e.dtype == torch.uint8
    assert e.shape == (24, 8)
    blocks = w.double().numpy().reshape(24, -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        x = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    np.testing.assert_array_equal(e.numpy().astype(np.int64), x + 127, err_msg=f"seed {SEED}")
    assert e[1, 1].item() == 127
    q_ref = _codes_ref(blocks / np.exp2(x)[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(codes.numpy(), q_ref, err_msg=f"seed {SEED}")
    assert quant.dequantize_fp4(codes, e)[1, 32:64].abs().max().item() == 6.0
    deq = (_values_ref(q_ref).reshape(blocks.shape) * np.exp2(x)[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(quant.dequantize_fp4(codes, e).double().numpy(), deq, err_msg=f"seed {SEED}")
    # a value just below a power of two keeps the lower exponent (read off the bits, not a rounded log2)
    edge = torch.full((1, 32), 0.0)
    edge[0, 0] = float(np.nextafter(np.float32(4.0), np.float32(0)))
    assert quant.mxfp4_quantize(edge)[1].item() == 127 + 1 - 2


def test_values_times_block_scales_are_exact_in_bfloat16_so_the_runtime_layer_is_exact():
    """The runtime holds E2M1 x block scale as a bfloat16 weight: lossless for every code and every finite E4M3 scale
    (and every E8M0 scale a float32 weight can need); in float32 the layer equals the float64 reference to float32
    rounding, in bfloat16 to bfloat16 rounding."""
    from llmq.pipeline.quantize.fp4 import quantize_weight
    from llmq.runtime.layers.fp4 import FP4Linear

    codes = torch.arange(16, dtype=torch.uint8).repeat(127, 1).repeat_interleave(16, 1)   # [127, 256]
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(127, 1).expand(127, 16)
    v = quant.dequantize_fp4(codes, e4m3.contiguous())
    assert torch.equal(v.to(torch.bfloat16).float(), v)
    e8m0 = torch.arange(0, 253, 2, dtype=torch.uint8).reshape(127, 1).expand(127, 8).contiguous()  # 2^-127..2^125
    v = quant.dequantize_fp4(codes, e8m0)
    assert torch.isfinite(v).all()
    assert torch.equal(v.to(torch.bfloat16).float(), v)
    w = _weight(n=48, k=64)
    x = torch.from_numpy(np.random.default_rng(SEED).standard_normal((5, 64)).astype(np.float32))
    for fmt in ("nvfp4", "mxfp4"):
        qw = quantize_weight(w, fmt)
        want = x.double() @ qw.dequantize().double().T
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
            got = FP4Linear(qw, None, dtype, "cpu")(x.to(dtype)).double()
            assert ((got - want).abs().max() / want.abs().max()).item() < tol, (fmt, dtype, f"seed {SEED}")



_TRITON_CHECK = """
import json, torch
from llmq import quant
from llmq.runtime.layers import fp4_triton
codes = torch.arange(16, dtype=torch.uint8).repeat(127, 1).repeat_interleave(16, 1)   # every code x every scale
e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(127, 1).expand(127, 16).contiguous()
e8m0 = torch.arange(28, 228, 2, dtype=torch.uint8).reshape(100, 1).expand(100, 8).contiguous()  # 2^-99..2^99
codes, e4m3, e8m0 = codes.repeat(1, 8), e4m3.repeat(1, 8), e8m0.repeat(1, 8)   # K = 2048: enough to split K
gen = torch.Generator().manual_seed(%d)
out, splits = {}, {}
for name, scale, group in (("nvfp4", e4m3, 16), ("mxfp4", e8m0, 32)):
    c = codes[:scale.shape[0]]
    w = quant.dequantize_fp4(c, scale, None, torch.float64)
    for m in (1, 5, 33):     # 1: the matrix-vector kernel; 33: a partial second row tile
        x = torch.randn(m, 2048, generator=gen)
        ref = x.double() @ w.T
        y = fp4_triton.fp4_matmul(x.float(), quant.pack_fp4(c), scale, group)
        # each output against the sum of its terms' magnitudes (float32 summation error is a few 2^-24 of that; a
        # wrong code, scale or index is O(1)); the E8M0 rows span 2^-99..2^99 and stay clear of float32's range ends
        size = x.double().abs() @ w.abs().T
        err = (y.double() - ref).abs() / torch.where(size > 0, size, 1.0)   # scale 0: a zero row, must give 0
        out[f"{name} m={m}"] = err.max().item()
splits = [fp4_triton.plan(m, 127, 2048, fp4_triton._num_sms(torch.device("cpu")))[3] for m in (1, 5)]
print(json.dumps({"errors": out, "splits": splits}))
"""


def test_triton_kernel_decodes_every_code_and_scale_as_the_float64_reference():
    """The CUDA layer's Triton kernel, run by Triton's interpreter on CPU (float32 activations): every E2M1 code under
    every E4M3 scale (subnormal ones too) and every E8M0 exponent, partial tiles, both kernels split over K, equal
    to the float64 dequantize-then-matmul within float32 summation error, output by output. A wrong nibble order,
    scale decode or block index is off by O(1)."""
    import subprocess
    import sys

    pytest.importorskip("triton")  # a test dependency on Linux x86_64 (pyproject's test extra); absent elsewhere
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _TRITON_CHECK % SEED], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert min(got["splits"]) > 1, got   # both kernels' split-K (atomic adds) ran
    assert len(got["errors"]) == 6, (got, f"seed {SEED}")
    assert max(got["errors"].values()) < 1e-5, (got, f"seed {SEED}")

# -- the checkpoint ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("fp4")
    store = Store(d / "store")
    return store, resolve_model(str(tiny_model(seed=3, bf16=True)), store)


@pytest.fixture(scope="module")
def quantized(source):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    made = {}

    def get(method):
        if method not in made:
            made[method] = quantize(src, QuantizeOptions(method=method, probe_tokens=256), store, progress=False)
        return made[method]

    return get


LAYOUT = {"nvfp4": ("nvfp4-pack-quantized", 16, "tensor_group", "torch.float8_e4m3fn",
                    {"weight_packed", "weight_scale", "weight_global_scale"}),
          "mxfp4": ("mxfp4-pack-quantized", 32, "group", "torch.uint8", {"weight_packed", "weight_scale"})}


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_checkpoint_is_what_compressed_tensors_decompresses(quantized, method):
    """The config is compressed-tensors' own preset (NVFP4A16 / MXFP4A16), the tensors have its dtypes and shapes, and
    its decompressor (the compressor registered for the format) gives exactly llmq's dequantized weights."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    fmt, block, strategy, scale_dtype, names = LAYOUT[method]
    art = quantized(method)
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    assert cfg["format"] == fmt
    assert cfg["ignore"] == ["lm_head"]
    (group,) = cfg["config_groups"].values()
    preset = preset_name_to_scheme(f"{method.upper()}A16", ["Linear"]).weights.model_dump(mode="json",
                                                                                          exclude_none=True)
    assert group["weights"] == preset
    assert group["weights"]["strategy"] == strategy
    assert group["weights"]["scale_dtype"] == scale_dtype
    assert art.config["scheme"] == f"{method.upper()}A16"
    assert art.config["group_size"] == block
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    qc = qformat.parse_quantization_config(ck.config)
    seen = 0
    for key in ck.tensors:
        if not key.endswith(".weight_packed"):
            continue
        prefix = key[:-len(".weight_packed")]
        stored = {k[len(prefix) + 1:]: ck.tensors[k] for k in ck.tensors if k.startswith(prefix + ".")}
        assert set(stored) == names
        n, half = stored["weight_packed"].shape
        assert stored["weight_packed"].dtype == torch.uint8
        assert stored["weight_scale"].shape == (n, 2 * half // block)
        qw = qformat.read_linear(ck.tensors, prefix, qc)
        assert qw.fp4 == method
        assert qw.scheme == f"{method.upper()}A16"
        ct = compressor.decompress(stored, scheme)["weight"]   # compressed-tensors computes in float32, returns bf16
        assert ct.dtype == torch.bfloat16, prefix
        assert torch.equal(ct, qw.dequantize(torch.bfloat16)), prefix
        assert torch.equal(qformat.write_linear(prefix, qw)[key], stored["weight_packed"])   # read back, written again
        seen += 1
    assert seen == 14   # 7 linears x 2 layers


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_transformers_loads_the_checkpoint_with_llmqs_weights(quantized, method):
    """transformers' compressed-tensors loader reads the checkpoint and holds exactly llmq's weights (in bfloat16:
    compressed-tensors decompresses FP4 to bfloat16, and transformers 5.23 cannot then run the model in float32)."""
    from transformers import AutoModelForCausalLM

    art = quantized(method)
    ck = CheckpointReader(art.path)
    qc = qformat.parse_quantization_config(ck.config)
    model = AutoModelForCausalLM.from_pretrained(art.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert len(names) == 14
    for name in names:
        want = qformat.read_linear(ck.tensors, name, qc).dequantize(torch.bfloat16)
        assert torch.equal(model.get_submodule(name).weight.data, want), name


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_runtime_equals_a_float64_dequantize_then_matmul_model(source, quantized, method):
    """llmq's runtime over the checkpoint against transformers in float64 with every linear's weight set to llmq's
    dequantized values (exact in float64): equal up to float32 summation error. The probe measured the same."""
    from transformers import AutoModelForCausalLM

    art = quantized(method)
    ck = CheckpointReader(art.path)
    qc = qformat.parse_quantization_config(ck.config)
    ref = AutoModelForCausalLM.from_pretrained(source[1].path, dtype=torch.float64).eval()
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.weight.data = qformat.read_linear(ck.tensors, name, qc).dequantize(torch.float32).double()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        want = torch.log_softmax(ref(ids).logits.double(), -1)[0]
    got = llmq_logits(art.path, ids)[0].double()
    err = (got - want).abs().max().item()
    assert err < 2e-5, f"seed {SEED}: {err}"
    with torch.no_grad():   # the model without FP4 weights is far away: the comparison can see a wrong weight
        dense = torch.log_softmax(AutoModelForCausalLM.from_pretrained(source[1].path, dtype=torch.float64)(ids)
                                  .logits, -1)[0]
    assert (dense - want).abs().max().item() > 1000 * err
    assert 0 < art.metrics["probe"]["kld_mean"] < 1


@pytest.mark.parametrize("family, method", [("phi3", "nvfp4"), ("gemma3_text", "mxfp4"), ("qwen3", "nvfp4")])
def test_other_families_compute_the_float64_reference_too(tmp_path, family, method):
    """Phi-3's stored-fused q/k/v (one tensor, one global scale), Gemma 3's and Qwen3's layers: the runtime over the
    FP4 checkpoint against the float64 dequantize-then-matmul model."""
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store = Store(tmp_path / "store")
    path = make_tiny_model(tmp_path / family, seed=5, model_type=family, head_dim=16)
    art = quantize(resolve_model(str(path), store), QuantizeOptions(method=method, probe_tokens=0), store,
                   progress=False)
    ck = CheckpointReader(art.path)
    qc = qformat.parse_quantization_config(ck.config)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    for name, mod in ref.named_modules():
        qw = qformat.read_linear(ck.tensors, name, qc) if isinstance(mod, torch.nn.Linear) else None
        if qw is not None:
            mod.weight.data = qw.dequantize().double()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        want = torch.log_softmax(ref(ids).logits.double(), -1)[0]
    assert (llmq_logits(art.path, ids)[0].double() - want).abs().max().item() < 2e-5, f"seed {SEED}"


def test_nvfp4_units_share_one_global_scale_as_fused_engines_read_them(quantized):
    """q/k/v and gate/up (the units engines fuse into one matmul) share one global scale, from the unit's max |w|:
    vLLM's compressed-tensors NVFP4 layer keeps one global scale per fused layer, the max of its parts'
    (process_weights_after_loading: weight_global_scale.max()), so dequantizing each part with that one scale gives
    exactly llmq's weights; o_proj and down_proj keep their own."""
    ck = CheckpointReader(quantized("nvfp4").path)
    for i in range(2):
        units = [[f"self_attn.{p}_proj" for p in "qkv"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"],
                 ["mlp.down_proj"]]
        scales = []
        for unit in units:
            parts = [ck.linear(f"model.layers.{i}.{n}").qw for n in unit]
            fused = max(p.global_scale.item() for p in parts)  # vLLM's rule
            for p in parts:
                amax = torch.stack([q.dequantize().abs().max() for q in parts]).max()
                assert p.global_scale.item() == fused  # one scale per unit
                vllm = quant.dequantize_fp4(p.q, p.scale, torch.tensor([fused]))
                assert torch.equal(vllm, p.dequantize().float())
            assert fused == pytest.approx(quant.NVFP4_GLOBAL / amax.item(), rel=0.02)  # from the unit's max |w|
            scales.append(fused)
        assert len(set(scales)) == 4  # the units' own


def test_fused_layer_of_parts_with_different_global_scales_keeps_each(quantized):
    """An imported checkpoint may give q/k/v different global scales: the runtime then keeps each part's own."""
    from llmq.runtime.loader import build_linear

    ck = CheckpointReader(quantized("nvfp4").path)
    parts = [ck.linear(f"model.layers.0.self_attn.{p}_proj") for p in "qkv"]
    parts = [replace(p, qw=replace(p.qw, global_scale=p.qw.global_scale * k))  # other global scales
             for p, k in zip(parts, (1.0, 0.5, 0.25))]
    assert len({p.qw.global_scale.item() for p in parts}) == 3
    layer = build_linear(parts, torch.float32, "cpu")
    x = torch.randn(5, 64)
    want = torch.cat([x.double() @ p.qw.dequantize().double().T for p in parts], -1)
    assert (layer(x).double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_tp2_build_splits_fp4_weights_and_passes_the_reference_check(source, quantized, method):
    """`build --tp 2`: codes and block scales are cut with their rows / columns (16- and 32-column blocks never
    straddle a rank), each rank keeps NVFP4's global scales, and the sharded engine reproduces the unsharded one."""
    from llmq.pipeline.targets import BuildOptions, build_engine

    eng = build_engine(quantized(method), source[0], BuildOptions(target="llmq", tp=2, verify=True))
    assert eng.metrics["verify"]["passed"]
    assert eng.metrics["verify"]["max_rel_error"] < 1e-5


def test_the_kv_budget_counts_fp4_weights_as_the_runtime_holds_them(source, quantized):
    """runtime_bytes (what the KV-cache budget subtracts) without a `kept` rule (no kernel holds the codes packed:
    the dense path) prices an FP4 linear at the bfloat16 / compute-dtype weight that path holds: as much as the source
    model, plus the block scales (packed on CPU: test_cpu_kernels)."""
    for compute in (torch.float32, torch.bfloat16):
        src = CheckpointReader(source[1].path).runtime_bytes(compute)
        for method in ("nvfp4", "mxfp4"):
            assert src < CheckpointReader(quantized(method).path).runtime_bytes(compute) < 1.05 * src


@pytest.mark.parametrize("args, match", [
    (["--method", "nvfp4", "--bits", "8"], "quantizes to 4 bits, not 8"),
    (["--method", "nvfp4", "--group-size", "32"], "blocks of 16 input columns"),
    (["--method", "mxfp4", "--group-size", "16"], "blocks of 32 input columns"),
    (["--method", "nvfp4", "--asym"], "symmetric"),
    (["--method", "mxfp4", "--per-tensor"], "--per-tensor"),
    (["--method", "nvfp4", "--activations", "static"], "drop --activations"),
    (["--method", "nvfp4", "--lm-head", "int8"], "needs a weight-only method"),
    (["--method", "mxfp4", "--target-bpw", "5"], "--target-bpw mixes"),
])
def test_unsupported_combinations_are_one_line_errors(source, args, match):
    from llmq.cli.main import cli

    store, src = source
    r = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", src.ref, *args])
    assert r.exit_code == 2, r.output
    assert match in r.output, r.output
    assert r.output.startswith("error: "), r.output
    assert r.output.strip().count("\n") == 0   # one line


def test_a_group_size_fp4_cannot_hold_is_refused_by_the_writer():
    with pytest.raises(LlmqError, match="no compressed-tensors format"):
        qformat.quantization_config(qformat.QuantArgs(4, type="float", strategy="group", group_size=64))


def test_cli_quantize_then_eval(source, tmp_path, monkeypatch):
    """`llmq quantize --method nvfp4` then `llmq eval` on the artifact: the commands a user runs."""
    from llmq.cli.main import cli

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store, src = source
    runner = CliRunner()
    q = runner.invoke(cli, ["--store", str(store.root), "quantize", src.ref, "--method", "nvfp4", "--name",
                            "tiny-nvfp4-cli", "--probe-tokens", "128"])
    assert q.exit_code == 0, q.output
    r = runner.invoke(cli, ["--store", str(store.root), "eval", "tiny-nvfp4-cli", "--tasks", "ppl,kld", "--limit",
                            "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert math.isfinite(rep["kld"]["mean"])
    assert rep["kld"]["mean"] > 0


# -- GGUF --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_built(tmp_path_factory):
    """{method: (artifact, GGUF engine)} from one tiny bf16 Llama."""
    from test_export_gguf import _bf16

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    d = tmp_path_factory.mktemp("fp4-gguf")
    store = Store(d / "store")
    src = resolve_model(str(_bf16(make_tiny_model(d / "tiny", seed=7))), store)
    out = {}
    for method in ("nvfp4", "mxfp4"):
        art = quantize(src, QuantizeOptions(method=method, probe_tokens=0), store, progress=False)
        out[method] = art, build_engine(art, store, BuildOptions(target="gguf"))
    return out


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_gguf_nvfp4_ffn_is_refused_where_llama_cpp_drops_its_scale(tmp_path, model_type):
    """llama.cpp's qwen2 / phi3 / gemma3 graphs build the FFN without `.scale` tensors: an NVFP4 FFN would compute g
    times too large there (Gemma 3 scored NaN in llama.cpp), so the build refuses it in one line and leaves no
    engine; MXFP4 (no global scale) still exports."""
    from test_export_gguf import _bf16

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    store = Store(tmp_path / "store")
    src = resolve_model(str(_bf16(make_tiny_model(tmp_path / "tiny", seed=3, model_type=model_type))), store)
    nv = quantize(src, QuantizeOptions(method="nvfp4", probe_tokens=0), store, progress=False)
    with pytest.raises(LlmqError, match=r"ffn_.*does not apply NVFP4's per-tensor scale to FFN matrices") as e:
        build_engine(nv, store, BuildOptions(target="gguf"))
    assert "\n" not in str(e.value)
    assert store.list(kind="engine") == []
    mx = quantize(src, QuantizeOptions(method="mxfp4", probe_tokens=0), store, progress=False)
    assert build_engine(mx, store, BuildOptions(target="gguf")).kind == "engine"


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_gguf_fp4_blocks_read_back_bit_exact(gguf_built, method):
    """Every FP4 linear is a GGUF NVFP4 / MXFP4 tensor that gguf-py's dequantizer (the NumPy twin of llama.cpp's)
    reads back as exactly llmq's E2M1 x block-scale values; NVFP4's global scale is the `.scale` tensor llama.cpp
    multiplies the output by, 1 / g in float32."""
    import gguf
    from test_export_gguf import _hf_name, _unpair_rope_rows, gguf_file

    art, eng = gguf_built[method]
    ck = CheckpointReader(art.path)
    r = gguf.GGUFReader(gguf_file(eng))
    tensors = {t.name: t for t in r.tensors}
    blocks = [t for t in r.tensors if t.tensor_type.name == method.upper()]
    assert len(blocks) == 14
    want_ftype = gguf.LlamaFileType.MOSTLY_NVFP4 if method == "nvfp4" else gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    assert r.fields["general.file_type"].contents() == int(want_ftype)
    for t in blocks:
        qw = ck.linear(_hf_name(t.name)[:-len(".weight")]).qw
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(qw.shape)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):   # llama.cpp's RoPE pairs rows (2i, 2i + 1)
            w = _unpair_rope_rows(w, 4 if "attn_q" in t.name else 2)
        assert np.array_equal(w, quant.dequantize_fp4(qw.q, qw.scale).numpy()), t.name
        scale = tensors.get(t.name.replace(".weight", ".scale"))
        if method == "mxfp4":
            assert scale is None
        else:
            assert scale.tensor_type.name == "F32"
            assert scale.data.tolist() == [(1 / qw.global_scale.double()).float().item()]
    rounding = json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]["rounding"]
    assert rounding["nvfp4_global_scales_as_float32_reciprocals"] == (14 if method == "nvfp4" else 0)
    assert rounding["max_global_scale_rel_error"] <= 2 ** -24


def test_gguf_mxfp4_file_computes_what_the_artifact_does(gguf_built):
    """A reader built from the GGUF file alone gives the artifact's own exactly dequantized model's logits."""
    from test_export_gguf import exact_artifact_model, gguf_file, read_gguf, reader_logprobs

    art, eng = gguf_built["mxfp4"]
    model, _ = read_gguf(gguf_file(eng))
    want = exact_artifact_model(art.path)
    ids = [int(x) for x in torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(SEED))]
    assert torch.equal(reader_logprobs(model, ids), reader_logprobs(want, ids))


def test_fp4_checkpoints_llmq_cannot_compute_are_refused_on_read(quantized):
    """An NVFP4 checkpoint whose config says 4-bit activations (llm-compressor's NVFP4 W4A4) but which lacks their
    input_global_scale is refused, not served as W4A16 (W4A4 itself: test_fp4_w4a4.py)."""
    ck = CheckpointReader(quantized("nvfp4").path)
    cfg = json.loads(json.dumps(ck.config))
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {**group["weights"], "dynamic": "local"}
    qc = qformat.parse_quantization_config(cfg)
    with pytest.raises(LlmqError, match="input_global_scale is missing"):
        qformat.read_linear(ck.tensors, "model.layers.0.mlp.up_proj", qc)
