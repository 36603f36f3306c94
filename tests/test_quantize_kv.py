"""llmq quantize-kv: calibrated KV-cache scales that match an independent reference, read back by qformat and the
runtime, a quantized cache that barely moves the model, and bad inputs refused with nothing written."""

import json

import pytest
import torch
from click.testing import CliRunner

from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.models import qformat as qf
from llmq.models import resolve_model
from llmq.models.load import load_tokenizer
from llmq.models.reader import CheckpointReader
from llmq.pipeline.kvcache import KVOptions, fake_quantize, quantize_kv
from llmq.pipeline.quantize.calib import load_calibration
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

SMALL = dict(num_samples=6, seq_len=96, probe_tokens=384)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model):
    """A tiny model artifact and its store (module-scoped: quantize-kv runs are shared by the tests below)."""
    from llmq.artifacts import Store

    d = tmp_path_factory.mktemp("kv")
    store = Store(d / "store")
    return store, resolve_model(str(tiny_model(seed=1)), store)


@pytest.fixture(scope="module")
def int8_art(tiny):
    store, src = tiny
    return quantize_kv(src, store, KVOptions(kv="int8", granularity="tensor", **SMALL), show_progress=False)


def _reference_amax(src, opts):
    """Per layer, per KV head absmax of K (after RoPE) and V over the calibration windows, from transformers'
    own cache (float64): an independent path to what the scales must be."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float64).eval()
    windows = load_calibration(opts.calib, load_tokenizer(src.path), opts.num_samples, opts.seq_len, 0).samples
    amax = None
    with torch.no_grad():
        for w in windows:
            cache = model(w[None], use_cache=True).past_key_values
            cur = torch.stack([torch.stack([lay.keys[0].abs().amax((1, 2)), lay.values[0].abs().amax((1, 2))])
                               for lay in cache.layers])  # [layers, 2, Hkv]
            amax = cur if amax is None else torch.maximum(amax, cur)
    return amax


def test_int8_per_tensor_scales_match_reference_and_load_in_runtime(tiny, int8_art):
    store, src = tiny
    ckpt = CheckpointReader(int8_art.path)
    assert int8_art.kind == "quantized"
    assert int8_art.parents == [src.id]
    assert ckpt.qconfig.format == "dense"
    assert ckpt.qconfig.weights is None
    assert ckpt.kv_cache_dtype() == "int8"
    ref = _reference_amax(src, KVOptions(kv="int8", **SMALL))
    for i in range(ckpt.spec.num_layers):
        k, v = ckpt.kv_scales(i)
        assert k.shape == v.shape == (1,)
        assert torch.allclose(k.double(), ref[i, 0].max() / 127, rtol=1e-4)
        assert torch.allclose(v.double(), ref[i, 1].max() / 127, rtol=1e-4)
    # weights untouched, config otherwise the same, metrics recorded
    src_ck = CheckpointReader(src.path)
    up = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(ckpt.tensor(up), src_ck.tensor(up))
    index = json.loads((int8_art.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.k_scale"] == "model-00002-of-00002.safetensors"
    assert index["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert not (int8_art.path / "model.safetensors").exists()  # else transformers would read it and skip the index
    m, c = int8_art.metrics, int8_art.config
    assert set(m["kv_error"]) == {"tensor", "head"}
    assert m["granularity"] == c["granularity"] == "tensor"
    assert 0 < m["kv_error"]["tensor"]["kv"] < 1e-3
    assert m["probe"]["tokens"] > 300
    assert m["probe"]["kld_mean"] < 1e-3
    assert m["probe"]["top1"] > 0.95
    assert c["calibration"]["samples"] == SMALL["num_samples"]
    assert c["calibration"]["source"].startswith("bundled:")
    eng = LLMEngine(int8_art.path, EngineConfig(kv_cache_memory=8 << 20))
    assert eng.kv_cache_dtype == "int8"
    assert eng.runner.caches[0].k.dtype == torch.int8
    eng.shutdown()
    # transformers (through compressed-tensors) finds the scales too
    from llmq.models.load import load_hf_model

    hf = load_hf_model(int8_art.path)
    assert torch.equal(hf.model.layers[1].self_attn.v_scale.detach().flatten(), ckpt.kv_scales(1)[1])


def test_int8_cache_output_stays_close_to_the_unquantized_model(tiny, int8_art):
    _, src = tiny
    cfg = EngineConfig(kv_cache_memory=8 << 20, enable_prefix_caching=False)
    base, quant = LLMEngine(src.path, cfg), LLMEngine(int8_art.path, cfg)
    prompts = ["The stone arch carries", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = [o.output_token_ids for o in base.generate(prompts, greedy)]
    outq = [o.output_token_ids for o in quant.generate(prompts, greedy)]
    # the first tokens agree exactly; teacher-forced on the unquantized continuation, the argmax nearly always does
    assert all(a[:4] == b[:4] for a, b in zip(outs, outq)), (outs, outq)
    agree = total = 0
    for p, o in zip(prompts, outs):
        ids = base.tokenizer.encode(p) + o
        lb, lq = base.prompt_logprobs(ids), quant.prompt_logprobs(ids)
        agree += int((lb.argmax(-1) == lq.argmax(-1)).sum())
        total += len(ids)
        assert float((lb.exp() * (lb - lq)).sum(-1).max()) < 0.01  # KL per position
    assert agree / total > 0.95
    base.shutdown()
    quant.shutdown()


def test_fp8_per_head_on_a_weight_quantized_artifact(tiny):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = tiny
    w8 = quantize(src, QuantizeOptions(bits=8, method="rtn", probe_tokens=0), store, progress=False)
    art = quantize_kv(w8, store, KVOptions(kv="fp8", granularity="head", **SMALL), show_progress=False)
    ckpt = CheckpointReader(art.path)
    assert ckpt.qconfig.format == "pack-quantized"
    assert ckpt.qconfig.weights.num_bits == 8
    assert ckpt.qconfig.kv.type == "float"
    assert ckpt.qconfig.kv.strategy == "attn_head"
    assert ckpt.linear_tensors("model.layers.0.mlp.down_proj")[1] is not None  # weights still quantized
    k, v = ckpt.kv_scales(0)
    assert k.shape == v.shape == (ckpt.spec.num_kv_heads,)
    assert not torch.equal(k, k.max().expand_as(k))
    assert art.config["source_weights"] == "pack-quantized"
    assert art.parents == [w8.id]
    eng = LLMEngine(art.path, EngineConfig(kv_cache_memory=8 << 20))
    assert eng.kv_cache_dtype == "fp8"
    assert eng.runner.caches[0].k_scale.shape == (ckpt.spec.num_kv_heads, 1)
    eng.shutdown()
    assert art.metrics["probe"]["kld_mean"] < 1e-2
    # an input that already has KV scales is refused, nothing written
    before = len(store.list())
    with pytest.raises(LlmqError, match="already carries calibrated fp8 KV-cache scales"):
        quantize_kv(art, store, KVOptions(kv="int8", **SMALL), show_progress=False)
    assert len(store.list()) == before


def test_fake_quantize_matches_a_float64_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 16, generator=gen) * torch.tensor([1.0, 5.0, 0.2])[None, :, None]
    s = x.abs().amax((0, 2)) / 127
    ref = (x.double() / s.double()[None, :, None]).round().clamp(-127, 127) * s.double()[None, :, None]
    assert torch.allclose(fake_quantize(x, s, "int8").double(), ref, atol=1e-6)
    assert ((fake_quantize(x, s, "int8") - x).abs() <= s[None, :, None] / 2 + 1e-6).all()
    s8 = x.abs().amax() / 448
    y = fake_quantize(x, s8.reshape(1), "fp8")
    assert ((y - x).abs() <= x.abs() * 2 ** -4 + s8 * 2 ** -9).all()


def test_kv_only_quantization_config_round_trips():
    cfg = {"quantization_config": qf.quantization_config(None, kv=qf.QuantArgs(8, strategy="tensor"))}
    assert cfg["quantization_config"]["format"] == "dense"
    assert cfg["quantization_config"]["config_groups"] == {}
    qc = qf.parse_quantization_config(cfg)
    assert qc.weights is None
    assert qf.kv_cache_dtype(qc) == "int8"
    assert qf.read_linear({"x.weight": torch.zeros(2, 2)}, "x", qc) is None
    with pytest.raises(LlmqError, match="KV-cache scheme and nothing else"):
        qf.quantization_config(None)
    with pytest.raises(LlmqError, match="format 'dense' is not supported"):
        qf.parse_quantization_config({"quantization_config": {"quant_method": "compressed-tensors", "format": "dense",
                                                              "config_groups": {}}})


def test_bad_inputs_are_refused_with_nothing_written(tiny, tmp_path):
    store, src = tiny
    before = len(store.list())
    with pytest.raises(LlmqError, match="--kv 'int4'"):
        quantize_kv(src, store, KVOptions(kv="int4"), show_progress=False)
    with pytest.raises(LlmqError, match="granularity"):
        quantize_kv(src, store, KVOptions(kv="int8", granularity="channel"), show_progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(LlmqError, match="empty"):
        quantize_kv(src, store, KVOptions(kv="int8", calib=str(empty)), show_progress=False)
    assert len(store.list()) == before

    def run(*args):
        return CliRunner().invoke(cli, ["--store", str(store.root), "quantize-kv", *args])

    r = run(src.ref, "--kv", "int4")
    assert r.exit_code == 2
    assert "int4" in r.output
    r = run(str(tmp_path / "missing-dir"), "--kv", "int8")
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: "), r.output
    assert r.output.count("\n") == 1, r.output
    assert len(store.list()) == before


@pytest.mark.integration
def test_default_model_int8_kv_cli(default_model, tmp_path):
    r = CliRunner().invoke(cli, ["--store", str(tmp_path / "store"), "quantize-kv", str(default_model.path), "--kv",
                                 "int8", "--num-samples", "4", "--seq-len", "256", "--heldout-tokens", "512", "--json"])
    assert r.exit_code == 0, r.output
    man = json.loads(r.output)
    ckpt = CheckpointReader(tmp_path / "store" / man["name"] / f"v{man['version']}")
    assert ckpt.spec.num_layers == 30
    assert ckpt.kv_cache_dtype() == "int8"
    shapes = {tuple(s.shape) for i in range(30) for s in ckpt.kv_scales(i)}
    assert shapes <= {(1,), (ckpt.spec.num_kv_heads,)}
    assert len(shapes) == 1
    m = man["metrics"]
    assert m["probe"]["tokens"] >= 500
    assert m["probe"]["kld_mean"] < 0.05
    assert m["probe"]["top1"] > 0.9
    assert m["kv_error"]["tensor"]["kv"] > 0
    assert m["kv_error"]["head"]["kv"] > 0
