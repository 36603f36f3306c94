"""GPT-OSS (attention sinks, biased attention and experts, a clamped SwiGLU, stacked experts, sliding layers beside
full ones) through quantize and quantize-kv: the float runtime against transformers at tp 1 and 2 is
test_families'. Here: the stacked experts are cut into each expert's linears and quantized one by one (their biases
and the router whole), what the runtime computes from the artifact is what the quantize probe recorded, a quantized
KV cache feeds the sinks' softmax as transformers' own sink attention does over K / V rounded the same way, and
TensorRT-LLM's checkpoint, which llmq does not write yet, is refused in one line (GGUF: test_export_gguf_gpt_oss).
OpenAI's own MXFP4 checkpoints (the releases' experts) are read as stored and computed as transformers computes
them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import family_config, family_model, kv_rounded_logits, make_tiny_model, runtime_logprobs, runtime_probe_kld

from llmq.errors import LlmqError
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize.probe import kld_top1

QUANTIZE = {"rtn": dict(method="rtn", bits=4, group_size=32), "gptq": dict(method="gptq", bits=4, group_size=32)}
PROBE_TOKENS = 256


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("gpt_oss")
    store = Store(d / "store")
    return store, resolve_model(str(family_model(d / "tiny", "gpt_oss")), store)


@pytest.mark.parametrize("name", list(QUANTIZE))
def test_each_expert_is_quantized_with_its_biases_and_the_runtime_computes_what_the_probe_recorded(source, quantized,
                                                                                                  name):
    art, src = quantized(name), source[1]
    ck, stacked = CheckpointReader(art.path), CheckpointReader(src.path)
    spec = ck.spec
    assert set(ck.config["quantization_config"]["ignore"]) >= {ck.arch.linear(i, "router") for i in range(2)}
    for i in range(spec.num_layers):
        lin, ref = ck.layer_linears(i), stacked.layer_linears(i)
        assert lin["router"].qw is None
        assert torch.equal(lin["router"].bias, ref["router"].bias)
        for e in range(spec.num_experts):
            for role in ("gate_proj", "up_proj", "down_proj"):
                got, want = lin[f"experts.{e}.{role}"], ref[f"experts.{e}.{role}"]
                assert got.qw is not None
                assert torch.equal(got.bias, want.bias)
                err = (got.dense(torch.float32) - want.weight).norm() / want.weight.norm()
                assert err < 0.2, (e, role, err)   # its own expert's weights (another's: ~1.4)
    got = runtime_probe_kld(src.path, art.path, PROBE_TOKENS)
    recorded = art.metrics["probe"]["kld_mean"]
    assert recorded > 1e-5
    assert abs(got / recorded - 1) < 5e-4


def test_a_quantized_kv_cache_feeds_the_sinks_softmax_as_transformers_does(source):
    """INT8 K / V per KV head under the calibrated scales, in both the sliding and the full layer: prefill and
    decode read the rounded cache through SDPA with the sink as one more score (the CPU kernel reads only 16 / 32-bit
    caches)."""
    from llmq.pipeline.kvcache import KVOptions, quantize_kv

    store, src = source
    art = quantize_kv(src, store, KVOptions(kv="int8", granularity="head", num_samples=4, seq_len=64,
                                            probe_tokens=64), show_progress=False)
    ck = CheckpointReader(art.path)
    scales = [ck.kv_scales(i) for i in range(ck.spec.num_layers)]
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    plain, ref = kv_rounded_logits(src.path, ids, "int8", scales)
    got = runtime_logprobs(art.path, ids[0].tolist())
    assert kld_top1(plain, got)["kld_mean"] > 1e-6   # the cache's rounding is visible
    assert kld_top1(ref, got)["kld_mean"] < 1e-7


def test_a_stacked_expert_tensor_of_the_wrong_shape_is_refused_naming_it(source, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = shutil.copytree(source[1].path, tmp_path / "bad")
    f = next(d.glob("*.safetensors"))
    st = load_file(f)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    st[name] = st[name][:, :, :-2].contiguous()   # one expert column pair short
    save_file(st, f, metadata={"format": "pt"})
    with pytest.raises(LlmqError, match=f"tensor {name} has shape \\[8, 96, 62\\], but config.json gives "
                                        "\\[8, 96, 64\\]"):
        resolve_model(str(d), Store(tmp_path / "store"))


def test_trtllm_refuses_gpt_oss_in_one_line(source, quantized):
    from llmq.pipeline.targets import BuildOptions, build_engine

    with pytest.raises(LlmqError, match="TensorRT-LLM's GPT-OSS checkpoint") as e:
        build_engine(quantized("rtn"), source[0], BuildOptions(target="trtllm"))
    assert "\n" not in str(e.value)


def test_the_artifact_stores_each_expert_s_linears_not_the_stacked_tensors(quantized):
    names = CheckpointReader(quantized("rtn").path).tensors
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert {"model.layers.0.mlp.experts.7.down_proj.bias", "model.layers.0.mlp.experts.7.up_proj.weight_packed",
            "model.layers.1.self_attn.sinks"} <= set(names)


def test_max_size_prices_the_stacked_experts_as_the_linears_they_are_stored_as(source):
    """`--max-size`: the stacked expert weights are decoder linears (a weight_shape and four entries per expert
    linear), their biases dense tensors; the checkpoint is float32, so a unit left dense takes four bytes a weight.
    The file is at most the size asked and short of it by less than the headers' allowance and one unit's upgrade
    (priced as two-byte weights, units left dense overshot the size)."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    common = dict(bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=0)
    plain = quantize(src, QuantizeOptions(**common), store, progress=False)
    limit = plain.metrics["size_bytes"] + 150_000   # the headers' allowance (256 bytes an entry) is ~80 kB here
    art = quantize(src, QuantizeOptions(max_size=f"{limit / 1000:g}kB", **common), store, progress=False)
    assert plain.metrics["size_bytes"] < art.metrics["size_bytes"] <= limit
    assert art.config["mixed_precision"]["count"]["int8"] > 0
    entries = len(CheckpointReader(art.path).tensors)
    assert limit - art.metrics["size_bytes"] < 256 * entries + 4 * 96 * 64


def openai_mxfp4(d, seed: int = 0, **overrides):
    """A tiny GPT-OSS (experts of width 64: two groups of 32 a rank at tp 2) in OpenAI's MXFP4 layout, as the
    releases ship it: each stacked expert weight replaced by random `_blocks` (E2M1 code pairs) and `_scales` (E8M0
    exponents 2^-5 .. 2^0), the quantization_config transformers' Mxfp4Config writes."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(d, seed=4, **family_config("gpt_oss") | {"intermediate_size": 64} | overrides)
    f = next(path.glob("*.safetensors"))
    st, g = load_file(f), torch.Generator().manual_seed(seed)
    for k in [k for k in st if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = st.pop(k).shape   # [experts, in, out]
        st[f"{k}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        st[f"{k}_scales"] = torch.randint(122, 128, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
    save_file(st, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_openai_s_mxfp4_experts_are_read_as_stored_and_computed_as_transformers_does(tmp_path, tp):
    """Imported into the store (every expert's codes and scales checked), each expert's MXFP4 weight holds the
    file's codes and scales themselves (no round trip through 16 bits), and the runtime, at tp 1 and split by expert
    width at tp 2, computes transformers' forward over its own dequantization of the file."""
    from transformers import AutoModelForCausalLM

    from llmq import quant
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    art = resolve_model(str(openai_mxfp4(tmp_path / "mx")), Store(tmp_path / "store"))
    ck = CheckpointReader(art.path)
    blocks = ck.tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    up = ck.layer_linears(1)["experts.3.up_proj"].qw   # rows 1, 3, 5, ... of expert 3's gate_up
    assert up.fp4 == "mxfp4"
    assert torch.equal(up.q, quant.unpack_fp4(blocks[3, 1::2].reshape(64, 48)))
    assert torch.equal(up.scale, ck.tensors["model.layers.1.mlp.experts.gate_up_proj_scales"][3, 1::2])
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(tp)).tolist()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(art.path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    got = kld_top1(ref, runtime_logprobs(art.path, ids, tp=tp))
    assert got["kld_mean"] < 1e-9, got
    assert got["top1"] == 1.0


def test_mxfp4_blocks_and_scales_that_disagree_are_refused_naming_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from llmq.artifacts import Store
    from llmq.models import resolve_model

    path = openai_mxfp4(tmp_path / "mx")
    f = next(path.glob("*.safetensors"))
    st = load_file(f)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    st[name] = st[name][:, :, :1].contiguous()   # one scale a row where the blocks have two groups
    save_file(st, f, metadata={"format": "pt"})
    store = Store(tmp_path / "store")
    with pytest.raises(LlmqError, match=r"model.layers.0.mlp.experts.down_proj_blocks uint8 \[8, 96, 2, 16\] and "
                                        r"model.layers.0.mlp.experts.down_proj_scales uint8 \[8, 96, 1\] do not hold "
                                        r"MXFP4 experts of \[96, 64\]") as e:
        resolve_model(str(path), store)
    assert "\n" not in str(e.value)
    assert not list(store.root.rglob("*.safetensors"))   # nothing stored


def test_the_kv_budget_prices_openai_s_mxfp4_experts_as_dequantized_where_no_kernel_keeps_them(tmp_path):
    """runtime_bytes (what the KV-cache budget subtracts) counts the `_blocks` as FP4 codes: without an FP4 kernel
    keeping them packed, as the float32 weights they become (the dense checkpoint's bytes, plus the scales), not as
    the bytes stored."""
    import math

    mx = CheckpointReader(openai_mxfp4(tmp_path / "mx"))
    dense = CheckpointReader(make_tiny_model(tmp_path / "dense", seed=4,
                                             **family_config("gpt_oss") | {"intermediate_size": 64}))
    scales = sum(math.prod(mx.tensors.info(n)[1]) for n in mx.tensors if n.endswith("_scales"))
    assert mx.runtime_bytes(torch.float32) == dense.runtime_bytes(torch.float32) + scales
