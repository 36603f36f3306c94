"""Import of ModelOpt-format checkpoints (`llmq.models.modelopt`): llmq's own `--target trtllm` output read back as the
model it came from, a FP8 checkpoint built here from ModelOpt's documented layout (hf_quant_config.json; `weight`
float8_e4m3fn, float32 scalars `weight_scale` / `input_scale`; `k_proj.k_scale` / `v_proj.v_scale`) imported,
served and exported again, NVFP4's multiplier-vs-divisor rounding pinned, and what llmq cannot read refused in one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import llmq_logits, make_tiny_model, small_engine
from safetensors.torch import load_file, save_file

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import modelopt, qformat, resolve_model
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.targets import BuildOptions, build_engine

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
ROUND_TRIP = {"W8A16": dict(bits=8), "W4A16_AWQ": dict(bits=4, group_size=64),
              "NVFP4": dict(method="nvfp4", w4a4=True)}
ULP = 2.0 ** -24   # float32's unit roundoff


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("modelopt")
    store = Store(root / "store")
    path = make_tiny_model(root / "tiny", seed=3)
    return store, resolve_model(str(path), store), path, root


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("algo", list(ROUND_TRIP))
def test_the_trtllm_export_reads_back_as_the_artifact_it_came_from(made, algo):
    """quantize -> build --target trtllm -> the checkpoint directory as a model: the same codes and scales, and the
    same logits (integers: bit for bit; NVFP4: llmq's global divisor is float32(1 / weight_scale_2), within float32
    rounding of the one it wrote)."""
    store, src, _, _ = made
    art = quantize(src, QuantizeOptions(**({"method": "rtn"} | ROUND_TRIP[algo]), probe_tokens=0), store,
                   progress=False)
    ckpt = build_engine(art, store, BuildOptions(target="trtllm")).path / "trtllm"
    assert json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    a, b = CheckpointReader(art.path), CheckpointReader(ckpt)
    assert b.qconfig.format == "modelopt"
    assert b.qconfig.ignores("lm_head")
    for i in range(2):
        for lin in LINEARS:
            qa, qb = a.linear(f"model.layers.{i}.{lin}").qw, b.linear(f"model.layers.{i}.{lin}").qw
            assert qb.scheme == qa.scheme, lin
            assert torch.equal(qb.q, qa.q), lin
            assert torch.equal(qb.scale, qa.scale), lin
            if algo == "NVFP4":
                assert torch.equal(qb.input_global_scale, qa.input_global_scale)
                assert (qb.global_scale - qa.global_scale).abs() <= 2 * ULP * qa.global_scale
    ours, theirs = llmq_logits(art.path, _ids()), llmq_logits(ckpt, _ids())
    if algo == "NVFP4":
        assert (ours - theirs).abs().max() < 1e-5
    else:
        assert torch.equal(ours, theirs)


def test_nvfp4_dequantization_against_modelopts_multiplier():
    """ModelOpt's weight is e2m1 * f32(block * weight_scale_2); llmq's e2m1 * f32(block / f32(1 / weight_scale_2)).
    Not bit-exact: about a fifth of the weights differ, by less than 2^-22 relative, and both lie within float32
    rounding of the float64 product (llmq three roundings, ModelOpt two)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 256), generator=g, dtype=torch.uint8)
    block = (torch.rand(64, 16, generator=g) * 400 + 1).to(quant.FP8)
    differ = total = 0
    for amax in torch.rand(50, generator=g) * 10 + 0.01:
        ws2 = (amax / 2688).float()
        tensors = {"x.weight": quant.pack_fp4(codes), "x.weight_scale": block, "x.weight_scale_2": ws2,
                   "x.input_scale": torch.tensor(0.01)}
        cfg = modelopt.parse_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
        ours = qformat.read_linear(tensors, "x", cfg).dequantize()
        e2m1 = quant.e2m1_values(codes).reshape(64, 16, 16)
        theirs = (e2m1 * (block.float() * ws2).unsqueeze(-1)).reshape(64, 256)
        ref = (e2m1.double() * (block.double() * ws2.double()).unsqueeze(-1)).reshape(64, 256)
        nz = ref != 0
        rel = lambda x: ((x.double() - ref).abs()[nz] / ref.abs()[nz]).max()  # noqa: E731
        assert rel(ours) <= 3 * ULP
        assert rel(theirs) <= 2 * ULP
        assert ((ours.double() - theirs.double()).abs()[nz] / theirs.double().abs()[nz]).max() < 4 * ULP
        differ, total = differ + int((ours != theirs).sum()), total + ours.numel()
    assert 0.1 < differ / total < 0.3


def write_fp8(src: Path, dst: Path, inline: bool = False) -> dict[str, torch.Tensor]:
    """A FP8 ModelOpt checkpoint of the dense model `src`, written from the layout: per linear `weight` float8
    [out, in] = e4m3(w / weight_scale), weight_scale = amax / 448 and a static input_scale, float32 scalars; the KV
    scales on k_proj / v_proj; lm_head excluded. inline: the flat config in config.json instead of the file."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors |= load_file(str(f))
    for i in range(2):
        for j, lin in enumerate(LINEARS):
            name = f"model.layers.{i}.{lin}"
            w = tensors[f"{name}.weight"].float()
            scale = (w.abs().max() / 448).float()
            tensors |= {f"{name}.weight": (w / scale).to(quant.FP8), f"{name}.weight_scale": scale,
                        f"{name}.input_scale": torch.tensor(0.01 + 0.002 * j, dtype=torch.float32)}
        attn = f"model.layers.{i}.self_attn"
        tensors |= {f"{attn}.k_proj.k_scale": torch.tensor(0.05 + i), f"{attn}.v_proj.v_scale": torch.tensor(0.07)}
    save_file(tensors, dst / "model.safetensors")
    if inline:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                                      "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False},
                                      "producer": {"name": "modelopt", "version": "1.0.0"}}
        (dst / "config.json").write_text(json.dumps(cfg))
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    return tensors


def test_a_modelopt_fp8_checkpoint_is_read_as_llmqs_fp8_static(made):
    """Every linear is FP8 per-tensor with its static input scale, exactly the stored values; its weights are the
    float64 product q * weight_scale rounded once to float32; the KV cache is FP8 under the stored scales; the flat
    inline config reads the same."""
    _, _, path, root = made
    dst = root / "fp8"
    tensors = write_fp8(path, dst)
    ck = CheckpointReader(dst)
    assert ck.kv_cache_dtype() == "fp8"
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            qw = ck.linear(name).qw
            assert qw.scheme == "FP8-tensor-static"
            assert torch.equal(qw.input_scale, tensors[f"{name}.input_scale"][None])
            ref = tensors[f"{name}.weight"].double() * tensors[f"{name}.weight_scale"].double()
            assert torch.equal(qw.dequantize(), ref.float())
        k, v = ck.kv_scales(i)
        assert k.item() == pytest.approx(0.05 + i)
        assert v.item() == pytest.approx(0.07)
    assert ck.linear("lm_head").qw is None
    write_fp8(path, root / "fp8-flat", inline=True)
    flat = CheckpointReader(root / "fp8-flat").qconfig
    assert (flat.weights, flat.input_activations, flat.kv, flat.ignore) == \
        (ck.qconfig.weights, ck.qconfig.input_activations, ck.qconfig.kv, ck.qconfig.ignore)


def test_an_imported_fp8_checkpoint_is_served_and_exported_again(made):
    """`llmq build DIR --target llmq` imports the directory (its quantization kept), the runtime serves it, and the
    re-export (compressed-tensors ranks) passes the reference check and computes the same logits."""
    from click.testing import CliRunner

    from llmq.cli.main import cli
    from llmq.runtime import SamplingParams

    store, _, path, root = made
    dst = root / "fp8-cli"
    write_fp8(path, dst)
    r = CliRunner().invoke(cli, ["--store", str(store.root), "build", str(dst), "--target", "llmq", "--verify"])
    assert r.exit_code == 0, r.output
    art = resolve_model(str(dst), store)   # the import the build made, found again
    assert json.loads((art.path / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    assert torch.equal(llmq_logits(dst, _ids(1)), llmq_logits(art.path, _ids(1)))
    built = build_engine(art, store, BuildOptions(target="llmq", verify=True))
    assert built.metrics["verify"]["passed"]
    rank = json.loads((built.path / "rank0" / "config.json").read_text())["quantization_config"]
    assert rank["quant_method"] == "compressed-tensors"
    assert rank["format"] == "float-quantized"
    assert torch.equal(llmq_logits(built.path, _ids(1)), llmq_logits(art.path, _ids(1)))
    e = small_engine(art.path)
    try:
        (out,) = e.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finally:
        e.shutdown()
    assert len(out.new_token_ids) == 5


@pytest.mark.parametrize("change, match", [
    ({"quant_algo": "W4A8_AWQ"}, r"quant_algo 'W4A8_AWQ' \(group_size None\) is not read by llmq; it reads FP8, "),
    ({"quant_algo": "NVFP4", "group_size": 32}, r"'NVFP4' \(group_size 32\) is not read"),
    ({"quant_algo": "W4A16_AWQ"}, r"'W4A16_AWQ' \(group_size None\) is not read .* W4A16_AWQ with a group_size"),
    ({"kv_cache_quant_algo": "INT8"}, r"kv_cache_quant_algo 'INT8' is not read by llmq; it reads FP8 KV caches"),
    ({"quant_algo": "MIXED_PRECISION"}, r"MIXED_PRECISION without quantized_layers .*quant_cfg.json"),
])
def test_unsupported_configs_are_one_line_errors_and_are_not_imported(made, change, match):
    store, _, path, root = made
    dst = root / f"bad-{len(list(root.iterdir()))}"
    write_fp8(path, dst)
    q = json.loads((dst / "hf_quant_config.json").read_text())
    q["quantization"] |= change
    (dst / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(LlmqError, match=match) as e:
        CheckpointReader(dst)
    assert "\n" not in str(e.value)
    before = {a.path for a in store.list()}
    with pytest.raises(LlmqError, match=match):
        resolve_model(str(dst), store)
    assert {a.path for a in store.list()} == before


@pytest.mark.parametrize("corrupt, match", [
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"), r"up_proj.weight_scale is missing .*float8"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3)}), r"do not fit; expected FP8"),
    (lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"), r"o_proj: FP8 without a static input_scale"),
    (lambda t: t.pop("model.layers.1.self_attn.v_proj.v_scale"), r"tensor model.layers.1.self_attn.v_scale is miss"),
])
def test_corrupt_tensors_are_one_line_errors(made, corrupt, match):
    _, _, path, root = made
    dst = root / f"corrupt-{len(list(root.iterdir()))}"
    tensors = write_fp8(path, dst)
    corrupt(tensors)
    save_file(tensors, dst / "model.safetensors")
    ck = CheckpointReader(dst)
    with pytest.raises(LlmqError, match=match):
        for i in range(2):
            ck.layer_linears(i)
            ck.kv_scales(i)


@pytest.mark.parametrize("key, value, match", [
    ("model.layers.0.mlp.up_proj.weight_scale", float("nan"), r"up_proj: weight scale holds nan at \[0\]"),
    ("model.layers.1.self_attn.o_proj.input_scale", 0.0, r"o_proj: input scale holds 0.0 at \[0\]"),
    ("model.layers.0.self_attn.k_proj.k_scale", float("inf"), r"layers.0.self_attn.k_scale holds inf at \[0\]"),
])
def test_non_finite_or_zero_scales_are_one_line_errors_and_are_not_imported(made, key, value, match):
    store, _, path, root = made
    dst = root / f"scale-{len(list(root.iterdir()))}"
    tensors = write_fp8(path, dst)
    tensors[key] = torch.tensor(value)
    save_file(tensors, dst / "model.safetensors")
    before = {a.path for a in store.list()}
    with pytest.raises(LlmqError, match=match) as e:
        resolve_model(str(dst), store)
    assert "\n" not in str(e.value)
    assert {a.path for a in store.list()} == before


def test_nvfp4_and_awq_tensors_that_do_not_fit_are_refused():
    cfg = modelopt.parse_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    t = {"x.weight": torch.zeros(8, 16, dtype=torch.uint8), "x.weight_scale": torch.zeros(8, 2).to(quant.FP8),
         "x.input_scale": torch.tensor(0.1)}
    with pytest.raises(LlmqError, match="weight_scale_2 is missing"):
        qformat.read_linear(t, "x", cfg)
    t["x.weight_scale"] = torch.zeros(8, 4).to(quant.FP8)
    with pytest.raises(LlmqError, match=r"do not fit; expected NVFP4: weight uint8 \[out, in/2\]"):
        qformat.read_linear(t, "x", cfg)
    awq = modelopt.parse_config({"producer": {"name": "modelopt"},
                                 "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 64}})
    t = {"x.weight": torch.zeros(4, 64, dtype=torch.int8), "x.weight_scale": torch.ones(8, 1),
         "x.pre_quant_scale": torch.full((64,), 2.0)}
    with pytest.raises(LlmqError, match="pre_quant_scale other than ones"):
        qformat.read_linear(t, "x", awq)
    t["x.pre_quant_scale"] = torch.ones(64)
    assert qformat.read_linear(t, "x", awq).group_size == 64


def test_invalid_hf_quant_config_json_is_one_line(made):
    _, _, path, root = made
    dst = root / "badjson"
    write_fp8(path, dst)
    (dst / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(LlmqError, match=r"hf_quant_config.json: not valid JSON"):
        CheckpointReader(dst)


def test_fp8_per_channel_per_token_reads_either_scale_shape():
    """FP8RowwiseLinearMethod's weight_scale [out] (ModelOpt) or compressed-tensors' [out, 1]: llmq's per-channel FP8
    with dynamic per-token activations, the values unchanged; any other shape is a one-line error."""
    cfg = modelopt.parse_config({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"})
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(8, 32, generator=g) * 100).to(quant.FP8)
    scale = torch.rand(8, generator=g) + 0.01
    ref = q.double() * scale.double()[:, None]
    for s in (scale, scale[:, None]):
        qw = qformat.read_linear({"x.weight": q, "x.weight_scale": s}, "x", cfg)
        assert qw.dynamic
        assert qw.input_scale is None
        assert qw.strategy == "channel"
        assert qw.activation_bits == 8
        assert torch.equal(qw.dequantize().double(), ref.float().double())
    with pytest.raises(LlmqError, match=r"^x: ModelOpt tensors .* expected FP8_PER_CHANNEL_PER_TOKEN"):
        qformat.read_linear({"x.weight": q, "x.weight_scale": scale[:4]}, "x", cfg)
