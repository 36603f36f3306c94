"""`llmq build --target gguf` of GPT-OSS as llama.cpp's `gpt-oss`, against that loader's contract
(src/models/openai-moe.cpp: the tensors it creates with their shapes, biases and sinks included; the sliding-window,
expert and YaRN keys it reads) and an independent reader that puts the file back into transformers' GPT-OSS (each
role's merged experts stacked and interleaved again). llama.cpp itself runs these files (benchmarks/gguf_in_llamacpp.py,
its figures in docs/build.md)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import family_config, make_tiny_model, runtime_logprobs
from test_export_gguf import TOKENS, _bf16_with_a_merge, _field, gguf_file, reader_logprobs

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.targets import BuildOptions, build_engine

gguf = pytest.importorskip("gguf")

# 4 layers sliding / full in turn, 8 experts of 64 (2 a token), YaRN as the releases (factor 32) over 64 positions,
# llama.cpp's SwiGLU clamp (limit 7)
CONFIG = family_config("gpt_oss") | dict(
    swiglu_limit=7.0, intermediate_size=64, num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                     "original_max_position_embeddings": 64, "rope_theta": 10000.0})
SCHEMES = {"bf16": (None, "BF16"), "mxfp4": (dict(method="mxfp4"), "MXFP4"),
           "w4-g32": (dict(method="rtn", bits=4, group_size=32), "Q4_0")}
TYPE_ID = {"F32": 0, "BF16": 30, "Q4_0": 2, "MXFP4": int(gguf.GGMLQuantizationType.MXFP4)}
BLOCK = {"F32": (1, 4), "BF16": (1, 2), "Q4_0": (32, 18), "MXFP4": (32, 17)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    store = Store(root / "store")
    model = resolve_model(str(_bf16_with_a_merge(make_tiny_model(root / "hf", seed=7, **CONFIG))), store)
    out = {}
    for scheme, (qopts, _) in SCHEMES.items():
        src = model if qopts is None else quantize(model, QuantizeOptions(probe_tokens=0, **qopts), store,
                                                   progress=False)
        out[scheme] = (src, build_engine(src, store, BuildOptions(target="gguf")))
    return store, model, out


def expected_tensors() -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, ne0 first; kind) as llama.cpp's openai-moe loader creates them."""
    c = CONFIG
    e, v, d, n, f = c["hidden_size"], 320, c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"token_embd.weight": ((e, v), "dense"), "output_norm.weight": ((e,), "f32"),
           "output.weight": ((e, v), "dense")}
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": ((e,), "f32"), b + "post_attention_norm.weight": ((e,), "f32"),
                b + "attn_q.weight": ((e, q), "linear"), b + "attn_k.weight": ((e, kv), "linear"),
                b + "attn_v.weight": ((e, kv), "linear"), b + "attn_output.weight": ((q, e), "linear"),
                b + "attn_q.bias": ((q,), "f32"), b + "attn_k.bias": ((kv,), "f32"), b + "attn_v.bias": ((kv,), "f32"),
                b + "attn_output.bias": ((e,), "f32"), b + "attn_sinks.weight": ((c["num_attention_heads"],), "f32"),
                b + "ffn_gate_inp.weight": ((e, n), "f32"), b + "ffn_gate_inp.bias": ((n,), "f32"),
                b + "ffn_gate_exps.weight": ((e, f, n), "linear"), b + "ffn_up_exps.weight": ((e, f, n), "linear"),
                b + "ffn_down_exps.weight": ((f, e, n), "linear"), b + "ffn_gate_exps.bias": ((f, n), "f32"),
                b + "ffn_up_exps.bias": ((f, n), "f32"), b + "ffn_down_exps.bias": ((e, n), "f32")}
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gpt_oss_file_meets_llama_cpp_loader_contract(built, scheme):
    _, _, out = built
    _, art = out[scheme]
    r = gguf.GGUFReader(gguf_file(art))
    assert _field(r, "general.architecture")[1] == "gpt-oss"
    want = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64,
            "attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True, False],
            "rope.dimension_count": 16, "rope.scaling.type": "yarn",
            "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 64,
            "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    for k, v in want.items():
        assert _field(r, f"gpt-oss.{k}")[1] == v, k
    assert "gpt-oss.rope.freq_base_swa" not in r.fields   # one rotary table: llama.cpp takes freq_base for both
    tensors = {t.name: t for t in r.tensors}
    expected = expected_tensors()
    assert set(tensors) == set(expected)
    for name, (shape, kind) in expected.items():
        typ = {"f32": "F32", "dense": "BF16", "linear": SCHEMES[scheme][1]}[kind]
        t = tensors[name]
        assert t.tensor_type == TYPE_ID[typ], name
        assert tuple(int(x) for x in t.shape) == shape, name
        per_block, nbytes = BLOCK[typ]
        assert t.n_bytes == int(torch.tensor(shape).prod()) // per_block * nbytes, name


def read_gpt_oss(path):
    """transformers' GPT-OSS from the GGUF file alone, as llama.cpp reads it: every tensor dequantized by gguf-py,
    each role's merged experts back into the stacked, gate / up interleaved parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    r = gguf.GGUFReader(path)
    g = lambda k: r.fields[f"gpt-oss.{k}"].contents()  # noqa: E731
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=len(r.fields["tokenizer.ggml.tokens"].contents()), hidden_size=g("embedding_length"),
        intermediate_size=g("expert_feed_forward_length"), num_hidden_layers=g("block_count"),
        num_attention_heads=g("attention.head_count"), num_key_value_heads=g("attention.head_count_kv"),
        head_dim=g("rope.dimension_count"), rms_norm_eps=g("attention.layer_norm_rms_epsilon"),
        num_local_experts=g("expert_count"), num_experts_per_tok=g("expert_used_count"),
        sliding_window=g("attention.sliding_window"), tie_word_embeddings=False,
        layer_types=["sliding_attention" if s else "full_attention" for s in g("attention.sliding_window_pattern")],
        rope_parameters={"rope_type": "yarn", "rope_theta": g("rope.freq_base"), "factor": g("rope.scaling.factor"),
                         "original_max_position_embeddings": g("rope.scaling.original_context_length"),
                         "beta_fast": g("rope.scaling.yarn_beta_fast"), "beta_slow": g("rope.scaling.yarn_beta_slow"),
                         "truncate": True})   # llama.cpp rounds the correction range
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight":
             "post_attention_layernorm.weight", "attn_sinks.weight": "self_attn.sinks",
             "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"}
    names |= {f"attn_{a}.{k}": f"self_attn.{b}_proj.{k}" for a, b in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                      ("output", "o")) for k in ("weight", "bias")}
    state, experts = {}, {}
    for t in r.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(x) for x in reversed(t.shape)]).astype("float32"))
        if t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            state[{"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                   "output_norm.weight": "model.norm.weight"}[t.name]] = w
            continue
        _, i, rest = t.name.split(".", 2)
        if rest.startswith("ffn_") and "_exps." in rest:
            experts.setdefault(i, {})[rest] = w
            continue
        state[f"model.layers.{i}.{names[rest]}"] = w
    for i, x in experts.items():
        m = f"model.layers.{i}.mlp.experts."
        gate, up = x["ffn_gate_exps.weight"].transpose(1, 2), x["ffn_up_exps.weight"].transpose(1, 2)
        state[m + "gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)   # [E, hidden, 2 x width]
        state[m + "gate_up_proj_bias"] = torch.stack([x["ffn_gate_exps.bias"], x["ffn_up_exps.bias"]], -1).flatten(-2)
        state[m + "down_proj"] = x["ffn_down_exps.weight"].transpose(1, 2)
        state[m + "down_proj_bias"] = x["ffn_down_exps.bias"]
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gpt_oss_reader_reproduces_llmq_runtime_logits(built, scheme):
    """What llama.cpp reads from the file computes what llmq's runtime computes on the artifact (INT4 / MXFP4 kernels
    take bf16 activations: KLD 1e-3); the BF16 file is the source model itself."""
    _, model, out = built
    src, art = out[scheme]
    got = reader_logprobs(read_gpt_oss(gguf_file(art)), TOKENS)
    assert kld_top1(runtime_logprobs(src.path, TOKENS), got)["kld_mean"] <= 1e-3
    if scheme == "bf16":
        from helpers import hf_model

        assert kld_top1(reader_logprobs(hf_model(model.path), TOKENS), got)["kld_mean"] <= 1e-9


def test_gpt_oss_reader_would_catch_the_sinks_left_out(built, tmp_path):
    """The bound has teeth: the file read without its sinks (zero logits still take a share) is far off."""
    _, _, out = built
    src, art = out["bf16"]
    model = read_gpt_oss(gguf_file(art))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert kld_top1(runtime_logprobs(src.path, TOKENS), reader_logprobs(model, TOKENS))["kld_mean"] > 1e-3


@pytest.mark.parametrize("override,words", [
    (dict(swiglu_limit=1.5), "clamps its SwiGLU with alpha 1.702 and limit 7.0"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "RoPE scaling 'linear'")])
def test_what_gpt_oss_gguf_cannot_hold_is_refused_in_one_line(built, tmp_path, override, words):
    store, _, _ = built
    src = resolve_model(str(make_tiny_model(tmp_path / "m", **{**CONFIG, **override})), store)
    with pytest.raises(LlmqError, match=words) as e:
        build_engine(src, store, BuildOptions(target="gguf"))
    assert "\n" not in str(e.value)


def test_untruncated_yarn_is_written_and_the_record_says_llama_cpp_rounds_it(built, tmp_path):
    """The releases' YaRN says truncate false; llama.cpp always rounds the correction range: the file is written
    (llama.cpp's own converter writes the same keys) and its record says where it departs from transformers."""
    store, _, _ = built
    cfg = {**CONFIG, "rope_parameters": {**CONFIG["rope_parameters"], "truncate": False}}
    src = resolve_model(str(_bf16_with_a_merge(make_tiny_model(tmp_path / "m", **cfg))), store)
    art = build_engine(src, store, BuildOptions(target="gguf"))
    record = json.loads((art.path / "engine.json").read_text())["outputs"]["gguf"]
    assert "truncate false" in record["rope"]


def test_openai_s_mxfp4_experts_go_into_the_file_as_stored(tmp_path):
    """A release-layout MXFP4 checkpoint exports without a round trip through 16 bits: every merged expert tensor is
    MXFP4 and decodes (gguf-py) to exactly transformers' own dequantization of the source file."""
    from test_gpt_oss import openai_mxfp4
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store

    store = Store(tmp_path / "store")
    path = _bf16_with_a_merge(openai_mxfp4(tmp_path / "mx", swiglu_limit=7.0))
    art = build_engine(resolve_model(str(path), store), store, BuildOptions(target="gguf"))
    experts = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[1].mlp.experts
    r = gguf.GGUFReader(gguf_file(art))
    t = {x.name: x for x in r.tensors}
    for role in ("gate", "up", "down"):
        x = t[f"blk.1.ffn_{role}_exps.weight"]
        assert x.tensor_type == gguf.GGMLQuantizationType.MXFP4
        got = torch.from_numpy(gguf.quants.dequantize(x.data, x.tensor_type).reshape(
            [int(n) for n in reversed(x.shape)]).astype("float32"))
        want = experts.down_proj if role == "down" else experts.gate_up_proj[..., {"gate": 0, "up": 1}[role]::2]
        want = want.transpose(1, 2)   # [experts, out, in]
        assert torch.equal(got, want.float()), role
