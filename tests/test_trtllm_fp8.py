"""`llmq build --target trtllm` of llmq's FP8 artifacts, and the FP8 KV cache as that backend runs it: quant_algo
FP8_PER_CHANNEL_PER_TOKEN (`--method fp8`: per-channel weights, dynamic per-token activations) and FP8 (`--per-tensor
--activations static`), checked against TensorRT-LLM's loader as data (tests/data/trtllm_loaders.json, recorded from
its code), read back by the independent reader and the ModelOpt import, with the loader's own changes (the fused
per-tensor rescale, an FP8 KV cache at scale 1.0) in what `--verify` scores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import llmq_logits
from safetensors.torch import load_file

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.reader import CheckpointReader
from llmq.models.sharding import make_plan
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.targets import BuildOptions, build_engine
from llmq.pipeline.targets.trtllm_loader import backend_computes

FACTS = json.loads((Path(__file__).parent / "data" / "trtllm_loaders.json").read_text())
FUSED = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
LINEARS = [f"{p}.{r}" for p, roles in FUSED.items() for r in roles] + ["self_attn.o_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("trtllm-fp8")
    store = Store(root / "store")
    src = resolve_model(str(tiny_model(seed=3, name="m", num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                                       hidden_size=192, intermediate_size=256)), store)
    calib = dict(num_samples=2, seq_len=32, probe_tokens=0)
    return store, src, {
        "channel": quantize(src, QuantizeOptions(method="fp8", probe_tokens=0), store, progress=False),
        "tensor-dynamic": quantize(src, QuantizeOptions(method="fp8", per_tensor=True, probe_tokens=0), store,
                                   progress=False),
        "tensor-static": quantize(src, QuantizeOptions(method="fp8", per_tensor=True, activations="static", **calib),
                                  store, progress=False),
        "channel-static": quantize(src, QuantizeOptions(method="fp8", activations="static", **calib), store,
                                   progress=False)}


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    return st


def _check_contract(st: dict, facts: dict, cfg: dict, layers: int) -> None:
    h, d, ff = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    dims = {"q_proj": (cfg["num_attention_heads"] * d, h), "k_proj": (cfg["num_key_value_heads"] * d, h),
            "v_proj": (cfg["num_key_value_heads"] * d, h), "o_proj": (h, cfg["num_attention_heads"] * d),
            "gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}
    for i in range(layers):
        for lin in LINEARS:
            n = f"model.layers.{i}.{lin}"
            out, inn = dims[lin.split(".")[1]]
            have = {k[len(n) + 1:]: t for k, t in st.items() if k.startswith(n + ".")}
            assert set(have) == set(facts["tensors"]), n
            for key, (dtype, shape) in facts["tensors"].items():
                assert str(have[key].dtype) == f"torch.{dtype}", (n, key)
                assert tuple(have[key].shape) == tuple({"out": out, "in": inn}[s] for s in shape), (n, key)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["channel", "tensor-dynamic"])
def test_fp8_per_token_artifacts_are_fp8_per_channel_per_token(made, kind, tp):
    """llmq's `--method fp8` is TensorRT-LLM's FP8 rowwise linear exactly: the same codes, each row's scale (a
    per-tensor one repeated), activations per token; tp 2 pads 6 / 3 heads to 8 / 4 and the backend shards."""
    facts = FACTS["fp8_per_channel_per_token"]
    store, _, a = made
    eng = build_engine(a[kind], store, BuildOptions(target="trtllm", tp=tp, verify=True))
    ckpt = eng.path / "trtllm"
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert facts["hf_quant_config"].items() <= q.items()
    assert "lm_head" in q["exclude_modules"]
    st, cfg = _tensors(ckpt), json.loads((ckpt / "config.json").read_text())
    _check_contract(st, facts, cfg, 2)
    v = eng.metrics["verify"]
    assert v["passed"]
    assert v["max_rel_error"] <= 1e-6
    # tp 2's padded heads change the float32 sums feeding the per-token FP8 rounding, which flips a few codes
    assert abs(v["target_kld"]) <= (1e-9 if tp == 1 else 1e-3)
    if tp == 1:   # the stored values, and the import of the checkpoint computes what llmq evaluated
        src = CheckpointReader(a[kind].path)
        for lin in LINEARS:
            n = f"model.layers.1.{lin}"
            qw = src.linear(n).qw
            assert torch.equal(st[f"{n}.weight"].view(torch.uint8), qw.q.view(torch.uint8))
            assert torch.equal(st[f"{n}.weight_scale"], qw.scale.float().expand(qw.shape[0], 1).reshape(-1))
        ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(1))
        assert torch.equal(llmq_logits(ckpt, ids), llmq_logits(a[kind].path, ids))


def _loader_rescaled(st: dict, names: list[str], dtype: torch.dtype) -> list[torch.Tensor]:
    """FP8QDQLinearMethod.rescale_fused_weights as the facts say, on the stored tensors."""
    top = max(float(st[f"{n}.weight_scale"]) for n in names)
    out = []
    for n in names:
        w = st[f"{n}.weight"].to(dtype)
        w.mul_(st[f"{n}.weight_scale"].reshape(())).div_(torch.tensor(top, dtype=torch.float32))
        out.append(w.to(torch.float8_e4m3fn))
    return out


def test_fp8_static_per_tensor_is_fp8_with_the_fused_rescale_scored(made):
    facts = FACTS["fp8"]
    store, _, a = made
    eng = build_engine(a["tensor-static"], store, BuildOptions(target="trtllm", verify=True))
    ckpt = eng.path / "trtllm"
    assert json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    st, cfg = _tensors(ckpt), json.loads((ckpt / "config.json").read_text())
    _check_contract(st, facts, cfg, 2)
    src = CheckpointReader(a["tensor-static"].path)
    computes = backend_computes(ckpt, torch.bfloat16)
    changed = 0
    for i in range(2):
        for prefix, roles in FUSED.items():
            names = [f"model.layers.{i}.{prefix}.{r}" for r in roles]
            scales = [float(st[f"{n}.weight_scale"]) for n in names]
            assert len(set(scales)) > 1, names   # the parts' amax differ, so the loader re-rounds
            for n, r, want in zip(names, roles, _loader_rescaled(st, names, torch.bfloat16)):
                qw = src.linear(n).qw
                assert torch.equal(st[f"{n}.weight"].view(torch.uint8), qw.q.view(torch.uint8))
                assert float(st[f"{n}.input_scale"]) == float(qw.input_scale)
                got = computes.layers[i][r].qw
                assert torch.equal(got.q.view(torch.uint8), want.view(torch.uint8)), n
                assert float(got.scale) == max(scales)
                assert float(got.input_scale) == max(float(st[f"{m}.input_scale"]) for m in names)
                changed += int(not torch.equal(want.view(torch.uint8), qw.q.view(torch.uint8)))
    assert changed   # some part's codes moved, and verify scored what the backend computes
    v = eng.metrics["verify"]
    assert v["passed"]
    assert v["max_rel_error"] <= 1e-6
    assert 0 < v["target_kld"] < 0.05


def test_fp8_the_backend_has_no_linear_for_is_refused(made):
    """Per-channel weights under a static activation scale, and weight-only FP8 (mixed precision's W8A16-FP8):
    every FP8 linear of the backend rounds activations its own way."""
    from llmq.pipeline.targets.trtllm import modelopt_algo

    store, _, a = made
    engines = len(store.list(kind="engine"))
    with pytest.raises(LlmqError, match=r"^FP8 weights per channel with a static activation scale: .*--per-tensor"):
        build_engine(a["channel-static"], store, BuildOptions(target="trtllm"))
    assert len(store.list(kind="engine")) == engines
    qw = CheckpointReader(a["channel"].path).linear("model.layers.0.mlp.up_proj").qw
    assert modelopt_algo(qw) == "FP8_PER_CHANNEL_PER_TOKEN"
    with pytest.raises(LlmqError, match=r"^FP8 weight-only \(W8A16-FP8\): .*--method fp8"):
        modelopt_algo(dataclasses.replace(qw, dynamic=False))


def test_an_fp8_kv_cache_is_scored_at_the_backends_scale_of_one(made):
    """The backend reads no k_scale / v_scale from the attention module, so its FP8 cache runs at 1.0: verify scores
    that against llmq's calibrated scales, which put this tiny model's K / V amax (~5) at 448."""
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.quantize.probe import kld_top1
    from llmq.pipeline.targets import verify

    store, src, _ = made
    art = quantize_kv(src, store, KVOptions(kv="fp8", granularity="tensor", num_samples=2, seq_len=32,
                                            probe_tokens=64), show_progress=False)
    eng = build_engine(art, store, BuildOptions(target="trtllm", kv="fp8", verify=True))
    ckpt = eng.path / "trtllm"
    reader = CheckpointReader(art.path)
    kmax = max(float(reader.kv_scales(i)[0]) for i in range(2))
    assert kmax < 0.05   # calibrated far from 1.0
    computes = backend_computes(ckpt, torch.bfloat16)
    assert all(torch.equal(s, torch.ones(())) for kv in computes.kv_scales for s in kv)
    v = eng.metrics["verify"]
    ids = torch.randint(0, reader.spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    plan = make_plan(reader.spec, 1)
    ref = verify.reference_weights(reader)
    calibrated = verify.run_plan([ref], plan, reader.config, ids, "fp8")
    unit = dataclasses.replace(ref, kv_scales=[(torch.ones(()), torch.ones(()))] * 2)
    at_one = kld_top1(calibrated, verify.run_plan([unit], plan, reader.config, ids, "fp8"))["kld_mean"]
    own = kld_top1(verify.run_plan([ref], plan, reader.config, ids), calibrated)["kld_mean"]
    assert v["passed"]
    assert v["kv_scale_mismatches"] == 0
    # the backend's cache at 1.0 against llmq's calibrated one: a loss of the size of FP8 KV itself (0.012 vs 0.006
    # here), where without the KV cache in the scoring it would read 0
    assert v["target_kld"] > 1e-3
    assert v["target_kld"] > own / 2
    assert v["target_kld"] == pytest.approx(at_one, rel=1e-3)
