"""`llmq build --target trtllm`: what TensorRT-LLM's PyTorch backend (trtllm-serve) loads, as data, and an independent
reader.

tensorrt_llm cannot be installed here, so this is a contract written from that backend's loader code (not copied):
`_torch/model_config.py` reads `hf_quant_config.json`'s "quantization" section; `_torch/modules/linear.py`'s
WeightOnlyQuantLinearMethod takes `weight` int8 [out, in] (INT4: [out/2, in], two rows a byte) and
`weight_scale` [out] and computes q * scale; W4A16_AWQ_LinearMethod takes `weight` int8 [out/2, in] and
`weight_scale` [out, in/group], reads `pre_quant_scale` for the layers it loads whole unconditionally, and runs
without zero points; `load_weight_shard` splits row-parallel tensors along their last dimension, and heads must divide
tp. `_torch/models/modeling_phi3.py` loads Phi-3's stored `qkv_proj` and `gate_up_proj` whole (WeightMode.VANILLA),
under those names. Its NVFP4LinearMethod reads `input_scale` (activations rounded to FP4, alpha = input_scale *
weight_scale_2) and asserts one `weight_scale_2` across a fused q/k/v or gate/up; `get_quant_method` has no dense MXFP4
method.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import llmq_logits
from safetensors.torch import load_file

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.targets import BuildOptions, build_engine

ROW_PARALLEL = ("o_proj", "down_proj")
WHOLE = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}  # what each family's loader loads whole
                                                                       # (default ROW_PARALLEL): AWQ's pre_quant_scale


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of a layer under the family's Hugging Face names."""
    h, d, ff = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    if cfg["model_type"] == "phi3":
        return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q), "mlp.gate_up_proj": (2 * ff, h),
                "mlp.down_proj": (h, ff)}
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h), "mlp.down_proj": (h, ff)}


def check_loads(ckpt: Path, tp: int) -> dict:
    """Every linear holds exactly the tensors its linear method declares, at shapes that shard over tp."""
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["num_attention_heads"] % tp == 0
    assert cfg["intermediate_size"] % tp == 0
    assert cfg["num_key_value_heads"] % tp == 0 or tp % cfg["num_key_value_heads"] == 0
    qfile = ckpt / "hf_quant_config.json"
    q = json.loads(qfile.read_text())["quantization"] if qfile.is_file() else {"quant_algo": None}
    algo = q["quant_algo"]
    assert algo in (None, "W8A16", "W4A16", "W4A16_AWQ")
    if algo == "W4A16_AWQ":
        assert q["has_zero_point"] is False
        assert q["pre_quant_scale"] is True
        assert q["group_size"] in (64, 128)
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    dims, whole = linear_shapes(cfg), WHOLE.get(cfg["model_type"], ROW_PARALLEL)
    for i in range(cfg["num_hidden_layers"]):
        for lin, (out, inn) in dims.items():
            name = f"model.layers.{i}.{lin}"
            w = st[f"{name}.weight"]
            if algo is None or name in q["exclude_modules"]:
                assert w.dtype.is_floating_point, name
                assert tuple(w.shape) == (out, inn), name
                continue
            assert w.dtype == torch.int8, name
            s = st[f"{name}.weight_scale"]
            if algo == "W8A16":
                assert tuple(w.shape) == (out, inn), name
                assert tuple(s.shape) == (out,), name
            elif algo == "W4A16":
                assert tuple(w.shape) == (out // 2, inn), name
                assert tuple(s.shape) == (out,), name
            else:
                g = q["group_size"]
                assert tuple(w.shape) == (out // 2, inn), name
                assert tuple(s.shape) == (out, inn // g), name
                if lin.rsplit(".", 1)[1] in whole:
                    assert torch.equal(st[f"{name}.pre_quant_scale"].float(), torch.ones(inn)), name
                    assert (inn // g) % tp == 0, f"{name}: its scale columns do not split over {tp} ranks"
        if q.get("kv_cache_quant_algo") == "FP8":
            for n in ("k_scale", "v_scale"):
                assert st[f"model.layers.{i}.self_attn.{n}"].numel() == 1
    return cfg


def _dequant(st: dict, name: str, q: dict) -> torch.Tensor:
    w = st[f"{name}.weight"]
    if w.dtype != torch.int8:
        return w.float()
    if q["quant_algo"] != "W8A16":
        b = w.view(torch.uint8).to(torch.int16)
        w = torch.stack([b & 0xF, b >> 4], 1).reshape(-1, w.shape[1])
        w = torch.where(w > 7, w - 16, w)
    s = st[f"{name}.weight_scale"].float()
    if s.dim() == 1:
        return w.float() * s[:, None]
    w = w.float() * s.repeat_interleave(w.shape[1] // s.shape[1], 1)
    pre = st.get(f"{name}.pre_quant_scale")
    return w * pre.float()[None, :] if pre is not None else w


def backend_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' forward over the checkpoint dequantized the way the backend's linear methods compute."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    qfile = ckpt / "hf_quant_config.json"
    q = json.loads(qfile.read_text())["quantization"] if qfile.is_file() else {"quant_algo": None}
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    sd = {k: v.float() for k, v in st.items() if not k.endswith(("_scale", "pre_quant_scale")) or "norm" in k}
    for i in range(cfg["num_hidden_layers"]):
        for lin in linear_shapes(cfg):
            name = f"model.layers.{i}.{lin}"
            sd[f"{name}.weight"] = _dequant(st, name, q)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}),
        dtype=torch.float32).eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return model(ids).logits


SCHEMES = {"bf16": None, "w8a16": dict(bits=8), "w4a16": dict(bits=4, group_size=0),
           "awq": dict(bits=4, group_size=64),   # a dense unit outside the fused groups (a split one: refused below)
           "awq-with-a-dense-layer": dict(bits=4, group_size=64, ignore=("lm_head", "model.layers.0.mlp.down_proj"))}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3_text", "phi3"])
def arts(tmp_path_factory, request, tiny_model):
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("trtllm")
    store = Store(root / "store")
    model = resolve_model(str(tiny_model(name="m", num_attention_heads=6, num_key_value_heads=3, hidden_size=384,
                                         intermediate_size=256, tie_word_embeddings=True, head_dim=64,
                                         model_type=request.param)), store)
    return store, {k: model if q is None else quantize(model, QuantizeOptions(method="rtn", **q), store, progress=False)
                   for k, q in SCHEMES.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_checkpoint_loads_and_computes_what_llmq_evaluated(arts, scheme, tp):
    store, a = arts
    if tp > 1 and json.loads((a[scheme].path / "config.json").read_text())["model_type"] == "phi3":
        # the backend's Phi-3 loads qkv_proj / gate_up_proj whole and would cut them by rows across ranks
        with pytest.raises(LlmqError, match=r"^--target trtllm: .* fused qkv_proj, gate_up_proj whole .*--tp 1"):
            build_engine(a[scheme], store, BuildOptions(tp=tp, target="trtllm"))
        return
    art = build_engine(a[scheme], store, BuildOptions(tp=tp, target="trtllm", verify=True))
    ckpt = art.path / "trtllm"
    cfg = check_loads(ckpt, tp)
    assert cfg["num_attention_heads"] == {1: 6, 2: 8, 4: 8}[tp]      # 6 heads / 3 KV: padded to 8 / 4 at tp 2, 4
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(tp))
    kld = kld_top1(llmq_logits(a[scheme].path, ids), backend_logits(ckpt, ids))["kld_mean"]
    assert kld <= 1e-3
    assert art.metrics["verify"]["passed"]
    assert art.metrics["verify"]["target_kld"] <= 1e-3
    opts = yaml.safe_load((ckpt / "llm_api_options.yaml").read_text())
    assert opts["tensor_parallel_size"] == tp
    assert art.metrics["compile"]["status"] == "pytorch-options"


def test_what_the_backend_cannot_load_is_refused_with_the_reason(arts):
    store, a = arts
    base = a["bf16"]
    for q, match in ((dict(bits=4, group_size=64, symmetric=False), "without zero points.*--sym"),
                     (dict(bits=4, group_size=32), "groups of 32"),
                     (dict(bits=5, group_size=32), "^INT5 weights: TensorRT-LLM runs INT4 and INT8 only")):
        art = quantize(base, QuantizeOptions(method="rtn", **q), store, progress=False)
        with pytest.raises(LlmqError, match=match):
            build_engine(art, store, BuildOptions(target="trtllm"))


def test_a_family_the_backend_has_no_model_of_is_refused(tmp_path, make_tiny_model):
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    store = Store(tmp_path / "store")
    src = resolve_model(str(make_tiny_model(tmp_path / "m", model_type="smollm3")), store)
    with pytest.raises(LlmqError, match="^--target trtllm: TensorRT-LLM's PyTorch backend has no SmolLM3 model; use "
                                        "--target llmq"):
        build_engine(src, store, BuildOptions(target="trtllm"))
    assert not list(store.root.rglob("engine.json"))


def test_fp4_weights_are_refused_in_one_line_before_anything_is_written(arts):
    """Neither of llmq's FP4 formats has a TensorRT-LLM dense linear that computes what llmq evaluated: NVFP4 there
    needs a calibrated activation scale, MXFP4 is MoE-only."""
    store, a = arts
    engines = len(store.list(kind="engine"))
    for method, match in (("nvfp4", r"^NVFP4 weight-only: .*input_scale .*--target llmq"),
                          ("mxfp4", r"^MXFP4 weight-only: .*MoE experts only.*--target llmq")):
        art = quantize(a["bf16"], QuantizeOptions(method=method, probe_tokens=0), store, progress=False)
        with pytest.raises(LlmqError, match=match) as e:
            build_engine(art, store, BuildOptions(target="trtllm"))
        assert "\n" not in str(e.value)
        if method == "nvfp4":
            nvfp4_refusal_holds(art.path, a["bf16"].path)
    assert len(store.list(kind="engine")) == engines


# TensorRT-LLM's NVFP4 loader as data (NVFP4LinearMethod.load_weight_scales): per linear `input_scale` (read, needed
# for alpha), `weight_scale` float8_e4m3fn [out, in/16], `weight_scale_2` float32 scalar, one per fused q/k/v and
# gate/up (asserted equal). ModelOpt writes weight_scale_2 = amax / (6 * 448) and multiplies by it; compressed-tensors
# (llmq) stores weight_global_scale = (6 * 448) / amax and divides by it (the seam llama.cpp PR #22858 names).
NVFP4_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def nvfp4_refusal_holds(path: Path, source: Path) -> None:
    """The refusal's reasons, checked on llmq's NVFP4 artifact, and the convention a future writer must translate."""
    from llmq.models.reader import CheckpointReader
    from llmq.quant import e2m1_values

    reader = CheckpointReader(path)
    lin, dense = reader.layer_linears(0), CheckpointReader(source).layer_linears(0)
    assert all(lin[r].qw.input_scale is None for group in NVFP4_FUSED for r in group)   # no activation scale
    if reader.arch.fused:   # Phi-3: q/k/v and gate/up quantized as the one linear they are stored as
        return
    group_of = {r: group for group in NVFP4_FUSED for r in group}
    for group in NVFP4_FUSED:                                                             # one per fused group, as
        assert len({float(lin[r].qw.global_scale) for r in group}) == 1                  # that loader asserts
    for role, lw in lin.items():
        qw = lw.qw
        amax = torch.stack([dense[r].weight.float().abs().max() for r in group_of.get(role, (role,))]).max()
        assert torch.equal(qw.global_scale, 2688 / amax.reshape(1))                      # a divisor: 2688 / amax
        assert qw.scale.float().max() <= 448                                              # amax's block at E4M3's top
        ws2 = amax / 2688                                                                 # ModelOpt's multiplier
        modelopt = e2m1_values(qw.q).reshape(*qw.scale.shape, -1) * (qw.scale.float() * ws2)[..., None]
        torch.testing.assert_close(modelopt.reshape(qw.q.shape), qw.dequantize(), rtol=6e-7, atol=0)


def test_a_mixed_artifact_with_an_fp4_unit_is_refused():
    import types

    from llmq.models.qformat import QConfig, QuantArgs
    from llmq.pipeline.targets.trtllm import refuse

    int4 = QuantArgs(num_bits=4, strategy="group", group_size=64)
    nvfp4 = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    q = QConfig(format="mixed-precision", weights=int4, input_activations=None, ignore=(), kv=None,
                modules={"model.layers.1.mlp.down_proj": nvfp4})
    with pytest.raises(LlmqError, match=r"^NVFP4 weight-only: "):
        refuse(types.SimpleNamespace(qconfig=q, arch=types.SimpleNamespace(trtllm_refused=None)),
               types.SimpleNamespace(kv_cache_dtype="auto"))


def test_sliding_window_goes_into_the_llm_api_options(make_tiny_model, store, tmp_path):
    src = resolve_model(str(make_tiny_model(tmp_path / "mistral", model_type="mistral", sliding_window=16)), store)
    art = build_engine(src, store, BuildOptions(tp=2, target="trtllm", verify=True))   # verify: 32 tokens > 16
    opts = yaml.safe_load((art.path / "trtllm/llm_api_options.yaml").read_text())
    assert opts["kv_cache_config"]["max_attention_window"] == [16]
    assert art.metrics["verify"]["passed"]
