"""FP4 with 4-bit activations (W4A4, `llmq quantize --method nvfp4 / mxfp4 --w4a4`): the activation rounding against
an independent NumPy reference of the serving kernels' recipe, the runtime layer against a float64 matmul of those
rounded activations, the checkpoint against compressed-tensors' presets and the loaders' reading of it.

The reference is written from the kernels' arithmetic (vLLM / FlashInfer / TensorRT-LLM `cvt_warp_fp16_to_fp4`,
vLLM's CPU `ref_nvfp4_quant`): every step in NumPy float32, the E4M3 and E2M1 roundings by brute-force nearest with
ties to the even code, sharing nothing with `llmq.quant`. Inputs are fresh random numbers each run (the seed is in
every failure message).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import make_tiny_model
from test_fp4 import E4M3, _codes_ref, _nearest_ref, _values_ref  # the FP4 references, shared

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import qformat
from llmq.models.reader import CheckpointReader

SEED = int.from_bytes(os.urandom(4), "little")
F32 = np.float32


def nvfp4_ref(x: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(codes [M, K], E4M3 scales [M, K / 16] as float64 values): s = e4m3(g * (amax * f32(1/6))),
    codes = e2m1(x * (1 / (s * (1 / g)))), all float32, as the kernel computes them."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 16)
    amax = np.abs(xb).max(-1)
    sf = (amax * F32(1 / 6)).astype(F32) * g
    s = E4M3[_nearest_ref(sf.astype(F32), E4M3)].astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(s != 0, F32(1) / (s * (F32(1) / g)), F32(0)).astype(F32)
    return _codes_ref((xb * inv[..., None]).astype(F32)).reshape(x.shape), s.astype(np.float64)


def mxfp4_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [M, K], biased E8M0 exponents [M, K / 32]): e = ceil(log2(amax * f32(1/6))), the kernels' round-up."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 32)
    v = (np.abs(xb).max(-1) * F32(1 / 6)).astype(F32)
    with np.errstate(divide="ignore"):
        e = np.where(v > 0, np.ceil(np.log2(v.astype(np.float64))), -127).clip(-127, 127)
    codes = _codes_ref(xb.astype(np.float64) / np.exp2(e)[..., None])   # a power of two: exact either way
    return codes.reshape(x.shape), (e + 127).astype(np.int64)


def _activations(m=40, k=128, gen=None) -> np.ndarray:
    """Activations with a spread of block magnitudes, exact zeros, an all-zero block and some outliers."""
    gen = gen or np.random.default_rng(SEED)
    x = gen.standard_normal((m, k)) * np.exp2(gen.integers(-10, 5, (m, k // 16))).repeat(16, 1)
    x[gen.random((m, k)) < 0.02] = 0.0
    x[0, :32] = 0.0
    x[1, 5] = 300.0
    return x.astype(np.float32)


def test_nvfp4_activations_match_the_kernel_recipe():
    x = _activations()
    g = F32(quant.NVFP4_GLOBAL) / F32(50.0)   # calibrated on max |x| = 50: x[1, 5] = 300 lies beyond it
    codes, scale = quant.fp4_activation_codes(torch.from_numpy(x), "nvfp4", torch.tensor([g]))
    c_ref, s_ref = nvfp4_ref(x, g)
    assert scale.dtype == torch.float8_e4m3fn
    assert scale.shape == (40, 8)
    np.testing.assert_array_equal(scale.double().numpy(), s_ref, err_msg=f"seed {SEED}")
    np.testing.assert_array_equal(codes.numpy(), c_ref, err_msg=f"seed {SEED}")
    assert scale[1, 0].item() == 448.0
    assert codes[1, 5].item() == 7   # past the calibrated amax: both saturate
    assert (codes[0, :32] == 0).all()
    assert (scale[0, :2].float() == 0).all()   # an all-zero block
    values, gd = quant.fp4_activations(torch.from_numpy(x), "nvfp4", torch.tensor([g]))
    assert values.dtype == torch.bfloat16
    assert gd.dtype == torch.float32
    assert gd.item() == g
    want = (_values_ref(c_ref).reshape(40, 8, 16) * s_ref[..., None]).reshape(40, 128)   # exact in float64
    np.testing.assert_array_equal(values.double().numpy(), want, err_msg=f"seed {SEED}")


def test_nvfp4_activation_conventions():
    """The input global scale divides, as the weight's: with g = 2688 / amax the block holding amax gets the largest
    E4M3 scale and amax comes back as 6 x 448 / g; a quotient on a midpoint goes to the even code."""
    amax = 3.25
    g = quant.nvfp4_global_scale(torch.tensor(amax))
    x = torch.zeros(1, 16)
    x[0, 0] = amax
    codes, s = quant.fp4_activation_codes(x, "nvfp4", g)
    assert s[0, 0].item() == 448.0
    assert codes[0, 0].item() == 7
    v, gd = quant.fp4_activations(x, "nvfp4", g)
    assert v[0, 0].item() / gd.item() == pytest.approx(amax, rel=2 ** -20)
    # g = 1 and block amax 48: s = e4m3(48 * f32(1/6)) = 8, the multiplier exactly 1/8; quotients 2.5 and 5 are
    # midpoints and go to the even codes (2 and 4), as cvt.rn.satfinite.e2m1 rounds
    y = torch.tensor([[48.0, 20.0, -40.0, 47.0] + [0.0] * 12])
    c, s = quant.fp4_activation_codes(y, "nvfp4", torch.tensor([1.0]))
    assert s.item() == 8.0
    assert quant.e2m1_values(c)[0, :4].tolist() == [6.0, 2.0, -4.0, 6.0]


def test_mxfp4_activations_match_the_kernel_recipe_and_never_saturate():
    x = _activations(k=256)
    x[2, 32:64] = np.linspace(-7.0, 7.0, 32)   # amax 7: 2^ceil(log2(7/6)) = 2, where the OCP weight rule takes 1
    codes, e = quant.fp4_activation_codes(torch.from_numpy(x), "mxfp4")
    c_ref, e_ref = mxfp4_ref(x)
    assert e.dtype == torch.uint8
    assert e.shape == (40, 8)
    np.testing.assert_array_equal(e.numpy().astype(np.int64), e_ref, err_msg=f"seed {SEED}")
    np.testing.assert_array_equal(codes.numpy(), c_ref, err_msg=f"seed {SEED}")
    assert e[2, 1].item() == 128
    assert quant.mxfp4_quantize(torch.from_numpy(x[2:3]))[1][0, 1].item() == 127
    blocks = np.abs(x.astype(np.float64)).reshape(40, -1, 32).max(-1)
    held = blocks / np.exp2(e.numpy().astype(np.float64) - 127)
    assert (held[blocks > 0] <= 6).all()
    assert (held[blocks > 0] > 3).all()   # the block max lands in (3, 6]
    values, gd = quant.fp4_activations(torch.from_numpy(x), "mxfp4")
    assert gd is None
    want = (_values_ref(c_ref).reshape(40, 8, 32) * np.exp2(e_ref - 127.0)[..., None]).reshape(40, 256)
    np.testing.assert_array_equal(values.double().numpy(), want, err_msg=f"seed {SEED}")
    # an exact power of two times 6 keeps its exponent (read off the bits: no rounding up)
    p = torch.zeros(1, 32)
    p[0, 0] = 6.0 * 2.0 ** -3
    assert quant.mxfp4_activation_scales(p).item() == 127 - 3


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a4_layer_is_the_float64_matmul_of_rounded_activations(fmt):
    """FP4Linear with FP4 activations: the float64 product of the reference's rounded activations and the dequantized
    weight, divided by both global scales (NVFP4), up to float32 summation; bfloat16 inputs are rounded from their own
    values."""
    from llmq.pipeline.quantize.fp4 import quantize_weight
    from llmq.runtime.layers.fp4 import FP4Linear

    gen = np.random.default_rng(SEED)
    w = torch.from_numpy((gen.standard_normal((48, 128)) * 0.05).astype(np.float32))
    x = _activations(m=7, gen=gen)
    ig = quant.nvfp4_global_scale(torch.tensor(float(np.abs(x).max()))) if fmt == "nvfp4" else None
    qw = dataclasses.replace(quantize_weight(w, fmt), dynamic=True, input_global_scale=ig)  # as quantize_layer does
    assert qw.scheme == fmt.upper()
    assert qw.activation_bits == 4
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        xin = torch.from_numpy(x).to(dtype)
        xr = xin.float().numpy()
        if fmt == "nvfp4":
            c, s = nvfp4_ref(xr, F32(ig.item()))
            xq = (_values_ref(c).reshape(7, 8, 16) * s[..., None]).reshape(7, 128) / np.float64(ig.item())
        else:
            c, e = mxfp4_ref(xr)
            xq = (_values_ref(c).reshape(7, 4, 32) * np.exp2(e - 127.0)[..., None]).reshape(7, 128)
        want = torch.from_numpy(xq) @ qw.dequantize().double().T
        got = FP4Linear(qw, None, dtype, "cpu")(xin).double()
        assert ((got - want).abs().max() / want.abs().max()).item() < tol, (fmt, dtype, f"seed {SEED}")
        if dtype == torch.float32:   # the comparison can see unrounded activations
            w4a16 = FP4Linear(qformat.QuantizedWeight(**{**qw.__dict__, "dynamic": False,
                                                         "input_global_scale": None}), None, dtype, "cpu")(xin)
            assert (w4a16.double() - want).abs().max().item() > 1000 * tol * want.abs().max().item()


# -- the checkpoint ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("w4a4")
    store = Store(d / "store")
    return store, resolve_model(str(tiny_model(seed=3)), store)


@pytest.fixture(scope="module")
def quantized(source):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    made = {}

    def get(method, w4a4=True):
        if (method, w4a4) not in made:
            made[method, w4a4] = quantize(src, QuantizeOptions(method=method, w4a4=w4a4, probe_tokens=256), store,
                                          progress=False)
        return made[method, w4a4]

    return get


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_checkpoint_is_compressed_tensors_w4a4_preset(quantized, method):
    """The config group is compressed-tensors' own NVFP4 / MXFP4 preset (weights and input_activations, the NVFP4
    activations dynamic "local" with the static_minmax observer), the format its pack-quantized FP4 one; NVFP4 stores
    `input_global_scale` float32 [1] beside the weight's, which vLLM's CompressedTensorsW4A4Fp4 creates and reads
    (one per fused part, PerTensorScaleParameter); read back, every linear is W4A4 again."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    art = quantized(method)
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    (group,) = cfg["config_groups"].values()
    preset = preset_name_to_scheme(method.upper(), ["Linear"])
    for part in ("weights", "input_activations"):
        assert group[part] == getattr(preset, part).model_dump(mode="json", exclude_none=True), part
    assert cfg["format"] == qformat.FP4_FORMATS[method][1]
    QuantizationScheme.model_validate(group)
    assert art.config["scheme"] == method.upper()
    assert art.name.endswith("-a4")
    qc = qformat.parse_quantization_config(ck.config)
    for key in [k for k in ck.tensors if k.endswith(".weight_packed")]:
        prefix = key[:-len(".weight_packed")]
        qw = qformat.read_linear(ck.tensors, prefix, qc)
        assert qw.dynamic
        assert qw.scheme == method.upper()
        ig = ck.tensors.get(f"{prefix}.input_global_scale")
        if method == "mxfp4":
            assert ig is None
            assert qw.input_global_scale is None
        else:
            assert ig.dtype == torch.float32
            assert ig.shape == (1,)
            assert torch.equal(qw.input_global_scale, ig)
        for k, t in qformat.write_linear(prefix, qw).items():
            assert torch.equal(t, ck.tensors[k]), k


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_transformers_loads_the_w4a4_checkpoint(quantized, method):
    """transformers' compressed-tensors loader reads the W4A4 checkpoint: llmq's weights, and for NVFP4 the
    `input_global_scale` parameter it registers for the activations holds llmq's value."""
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
        qw, mod = qformat.read_linear(ck.tensors, name, qc), model.get_submodule(name)
        assert torch.equal(mod.weight.data, qw.dequantize(torch.bfloat16)), name
        if method == "nvfp4":
            assert torch.equal(mod.input_global_scale.data.float(), qw.input_global_scale), name


def test_nvfp4_input_global_scale_is_calibrated_and_shared_per_unit(quantized):
    """2688 / the largest |x| a unit's linears saw in calibration (the input of q/k/v is one tensor, so is gate/up's):
    one value per fused unit, which vLLM's max over the parts and TensorRT-LLM's equality assertion both need."""
    ck = CheckpointReader(quantized("nvfp4").path)
    for i in range(2):
        units = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                 ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
        seen = []
        for unit in units:
            parts = [ck.linear(f"model.layers.{i}.{u}").qw for u in unit]
            gs = {p.input_global_scale.item() for p in parts}
            assert len(gs) == 1, unit
            seen.append(gs.pop())
        assert len(set(seen)) == 4
        assert all(0 < g < 1e6 for g in seen)


def test_gptq_rounded_w4a4_keeps_the_calibrated_input_scales(source, quantized):
    """--gptq --w4a4 together: GPTQ rounds the weights, and every linear still gets the W4A4 fields round-to-nearest's
    would (FP4 activations, NVFP4's calibrated input global scale, the same one: both come from the same calibration
    windows), and the GPTQ weights differ from round-to-nearest's."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    art = quantize(src, QuantizeOptions(method="nvfp4", gptq=True, w4a4=True, probe_tokens=256), store,
                   progress=False)
    assert art.name.endswith("-gptq-a4")
    gptq, rtn = CheckpointReader(art.path), CheckpointReader(quantized("nvfp4").path)
    name = "model.layers.0.mlp.up_proj"
    g, r = gptq.linear(name).qw, rtn.linear(name).qw
    assert g.dynamic
    assert g.input_global_scale is not None
    assert torch.equal(g.input_global_scale, r.input_global_scale)
    assert not torch.equal(g.q, r.q)


def test_the_probe_measures_w4a4(quantized):
    """The quality probe runs the runtime's layers, so it measures the activation rounding: W4A4 moves further from the
    source than W4A16 of the same weights."""
    for method in ("nvfp4", "mxfp4"):
        a4, a16 = quantized(method).metrics["probe"], quantized(method, False).metrics["probe"]
        assert a4["kld_mean"] > a16["kld_mean"] > 0, (method, a4, a16)


def test_runtime_serves_the_w4a4_checkpoint_as_w4a4(quantized):
    """llmq's engine over the W4A4 artifact builds W4A4 layers (fused q/k/v and gate/up keep their one input scale)."""
    from llmq.runtime.layers.fp4 import FP4Linear
    from llmq.runtime.loader import build_linear

    ck = CheckpointReader(quantized("nvfp4").path)
    parts = [ck.linear(f"model.layers.0.self_attn.{p}_proj") for p in "qkv"]
    layer = build_linear(parts, torch.float32, "cpu")
    assert isinstance(layer, FP4Linear)
    assert layer.act == "nvfp4"
    assert torch.equal(layer.input_global_scale, parts[0].qw.input_global_scale)


@pytest.mark.parametrize("args, match", [
    (["--method", "rtn", "--w4a4"], "--gptq / --w4a4 are the FP4 methods' options"),
    (["--method", "nvfp4", "--w4a4", "--activations", "static"], "drop --activations"),
])
def test_w4a4_option_errors_are_one_line(source, args, match):
    from llmq.cli.main import cli

    store, src = source
    r = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", src.ref, *args])
    assert r.exit_code == 2, r.output
    assert match in r.output, r.output
    assert r.output.startswith("error: "), r.output
    assert r.output.strip().count("\n") == 0


def test_fp4_activations_in_another_format_are_refused_on_read(quantized):
    """An NVFP4 checkpoint whose activations are not the NVFP4 preset's (here: FP8 per token) is refused, not served
    as something else."""
    ck = CheckpointReader(quantized("nvfp4").path)
    cfg = json.loads(json.dumps(ck.config))
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    qc = qformat.parse_quantization_config(cfg)
    with pytest.raises(LlmqError, match="these quantized activations"):
        qformat.read_linear(ck.tensors, "model.layers.0.mlp.up_proj", qc)


# -- TensorRT-LLM ------------------------------------------------------------------------------------------------------
# NVFP4LinearMethod (`_torch/modules/linear.py`) as data: `weight` [out, in/2] FP4 pairs, `weight_scale` float8_e4m3fn
# [out, in/16], `weight_scale_2` and `input_scale` float32 scalars asserted equal across a fused q/k/v or gate/up;
# ModelOpt's scalars are multipliers (amax / 2688): alpha = input_scale * weight_scale_2, and activations are quantized
# under 1 / input_scale by fp4_quantize (the kernel recipe above).
TRT_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _trtllm_logits(ckpt, ids, hooks: bool):
    """transformers over the TensorRT-LLM checkpoint, each NVFP4 linear's weight as the backend dequantizes it and,
    with `hooks`, its input rounded by the reference recipe under 1 / input_scale."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    sd, scales = {}, {}
    for k, v in st.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        name = k[:-len(".weight")]
        if v.dtype == torch.uint8:
            b = v.numpy()
            codes = np.stack([b & 15, b >> 4], -1).reshape(v.shape[0], -1)
            s = st[f"{name}.weight_scale"].float().numpy().astype(np.float64)
            w = (_values_ref(codes).reshape(*s.shape, 16) * s[..., None]).reshape(codes.shape)
            sd[k] = torch.from_numpy(w * float(st[f"{name}.weight_scale_2"])).float()
            scales[name] = F32(1) / F32(float(st[f"{name}.input_scale"]))
        else:
            sd[k] = v.float()
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}),
        dtype=torch.float32).eval()
    model.load_state_dict(sd, strict=True)
    if hooks:
        def rounding(g):
            def hook(_, args):
                x = args[0]
                flat = x.reshape(-1, x.shape[-1]).numpy()
                c, s = nvfp4_ref(flat, g)
                v = (_values_ref(c).reshape(*s.shape, 16) * s[..., None]).reshape(flat.shape) / np.float64(g)
                return (torch.from_numpy(v).float().reshape(x.shape),)
            return hook
        for name, g in scales.items():
            model.get_submodule(name).register_forward_pre_hook(rounding(g))
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), -1)


def test_trtllm_nvfp4_w4a4_checkpoint_is_what_the_backend_loads(source, quantized):
    """`build --target trtllm` of an NVFP4 W4A4 artifact: quant_algo NVFP4 with ModelOpt's tensors and scalar
    multipliers, one per fused unit; 1 / input_scale is llmq's input global scale exactly (the backend rounds
    activations as llmq did); the backend's computation (its dequantized weights, activations rounded by the recipe)
    matches what llmq's runtime evaluated; the reference check passes."""
    from helpers import llmq_logits

    from llmq.pipeline.quantize.probe import kld_top1
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _ = source
    art = quantized("nvfp4")
    eng = build_engine(art, store, BuildOptions(target="trtllm", verify=True))
    ckpt = eng.path / "trtllm"
    from pathlib import Path

    facts = json.loads((Path(__file__).parent / "data" / "fp4_w4a4_loaders.json").read_text())["tensorrt_llm_nvfp4"]
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert facts["hf_quant_config"].items() <= q.items()
    assert "lm_head" in q["exclude_modules"]
    assert eng.metrics["verify"]["passed"]
    rounding = json.loads((eng.path / "engine.json").read_text())["outputs"]["nvfp4_rounding"]
    assert rounding["input_scales_not_exactly_inverted"] == 0
    assert rounding["alpha_max_rel_error"] < 2 ** -22
    from safetensors.torch import load_file
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    ck = CheckpointReader(art.path)
    for i in range(2):
        for group in TRT_FUSED + (("o_proj",), ("down_proj",)):
            names = [f"model.layers.{i}.{'mlp' if r in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{r}"
                     for r in group]
            for key in ("weight_scale_2", "input_scale"):
                vals = {float(st[f"{n}.{key}"]) for n in names}
                assert len(vals) == 1, (names, key)
                assert all(st[f"{n}.{key}"].dtype == torch.float32 for n in names), (names, key)
            for n in names:
                qw = ck.linear(n).qw
                have = {k[len(n) + 1:]: t for k, t in st.items() if k.startswith(n + ".")}
                assert set(have) == set(facts["tensors"]), n
                for key, (dtype, shape) in facts["tensors"].items():
                    assert str(have[key].dtype) == f"torch.{dtype}", (n, key)
                    assert have[key].numel() == 1 if shape == "scalar" else \
                        tuple(have[key].shape) == _shape(shape, *qw.shape), (n, key)
                w, s = st[f"{n}.weight"], st[f"{n}.weight_scale"]
                assert w.dtype == torch.uint8
                assert tuple(w.shape) == (qw.shape[0], qw.shape[1] // 2)
                assert s.dtype == torch.float8_e4m3fn
                assert tuple(s.shape) == (qw.shape[0], qw.shape[1] // 16)
                assert torch.equal(1.0 / st[f"{n}.input_scale"], qw.input_global_scale.reshape(()))
                assert float(st[f"{n}.weight_scale_2"]) == pytest.approx(1 / qw.global_scale.item(), rel=2 ** -23)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(SEED))
    ours = llmq_logits(art.path, ids)
    near = kld_top1(ours, _trtllm_logits(ckpt, ids, hooks=True))["kld_mean"]
    far = kld_top1(ours, _trtllm_logits(ckpt, ids, hooks=False))["kld_mean"]
    assert near < 1e-4, (near, far, f"seed {SEED}")
    assert far > 10 * near, (near, far, f"seed {SEED}")


def test_trtllm_still_refuses_weight_only_nvfp4_and_mxfp4_w4a4(source, quantized):
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _ = source
    for method, w4a4, match in (("nvfp4", False, r"^NVFP4 weight-only: .*--w4a4"),
                                ("mxfp4", True, r"^MXFP4 weight-only: .*MoE experts only")):
        with pytest.raises(LlmqError, match=match):
            build_engine(quantized(method, w4a4), store, BuildOptions(target="trtllm"))


# -- GGUF --------------------------------------------------------------------------------------------------------------
def test_gguf_exports_w4a4_weights_exactly_and_says_the_activations_are_llamacpps(tmp_path):
    """llama.cpp's FP4 types are weight formats (its CPU dot products take Q8_0 activation blocks): the W4A4 artifact's
    GGUF holds exactly the W4A16 one's tensors, and its record says the activations are not carried."""
    import gguf
    from test_export_gguf import _bf16, gguf_file

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine
    from llmq.pipeline.targets.gguf_target import W4A4_NOTE

    store = Store(tmp_path / "store")
    src = resolve_model(str(_bf16(make_tiny_model(tmp_path / "tiny", seed=7))), store)
    files = {}
    for w4a4 in (False, True):
        art = quantize(src, QuantizeOptions(method="nvfp4", w4a4=w4a4, probe_tokens=0), store, progress=False)
        eng = build_engine(art, store, BuildOptions(target="gguf"))
        rec = json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]
        assert rec.get("activations") == (W4A4_NOTE if w4a4 else None)
        files[w4a4] = {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(gguf_file(eng)).tensors}
    assert files[True] == files[False]


def _shape(spec, out: int, inn: int) -> tuple[int, ...] | None:
    if spec == "scalar":
        return None
    return tuple({"out": out, "in/2": inn // 2, "in/16": inn // 16, "in/32": inn // 32, "1": 1}[d] for d in spec)


@pytest.mark.parametrize("loader, method", [("vllm_compressed_tensors_nvfp4", "nvfp4"),
                                            ("vllm_compressed_tensors_mxfp4", "mxfp4")])
def test_the_checkpoint_has_what_vllm_creates(quantized, loader, method):
    """Every quantized linear carries exactly the tensors vLLM's W4A4 scheme registers, with its dtypes and shapes
    (tests/data/fp4_w4a4_loaders.json)."""
    from pathlib import Path

    facts = json.loads((Path(__file__).parent / "data" / "fp4_w4a4_loaders.json").read_text())[loader]["tensors"]
    ck = CheckpointReader(quantized(method).path)
    prefixes = [k[:-len(".weight_packed")] for k in ck.tensors if k.endswith(".weight_packed")]
    assert len(prefixes) == 14
    for p in prefixes:
        out, inn = ck.linear(p).qw.shape
        have = {k[len(p) + 1:]: t for k, t in ck.tensors.items() if k.startswith(p + ".")}
        assert set(have) == set(facts), p
        for name, (dtype, shape) in facts.items():
            assert str(have[name].dtype) == f"torch.{dtype}"
            assert tuple(have[name].shape) == _shape(shape, out, inn)


def test_tp2_build_keeps_the_activation_scales_on_every_rank(source, quantized):
    """`build --tp 2`: each rank's column- and row-parallel W4A4 linears keep NVFP4's input global scale (one tensor
    for the whole input, whichever columns a rank holds) and the split passes the reference check."""
    from llmq.models.engine_spec import EngineSpec
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _ = source
    art = quantized("nvfp4")
    eng = build_engine(art, store, BuildOptions(target="llmq", tp=2, verify=True))
    assert eng.metrics["verify"]["passed"]
    ck = CheckpointReader(art.path)
    seen = 0
    for d in EngineSpec.read(eng.path).ranks:   # each rank directory is a sliced checkpoint
        rank = CheckpointReader(eng.path / d)
        for i in range(2):
            src = ck.layer_linears(i)
            for role, lw in rank.layer_linears(i).items():
                assert lw.qw.dynamic, role
                assert torch.equal(lw.qw.input_global_scale, src[role].qw.input_global_scale), role
                seen += 1
    assert seen == 2 * 2 * 7
