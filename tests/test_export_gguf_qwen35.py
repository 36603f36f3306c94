"""`llmq build --target gguf` of a hybrid (Qwen3.5: Gated DeltaNet and gated full-attention layers) as llama.cpp's
`qwen35`, and of Qwen3.5-MoE (experts and a gated shared expert for every MLP) as its `qwen35moe`, against those
loaders' contract (src/models/qwen35.cpp, qwen35moe.cpp: the tensors each kind of layer creates and their shapes, the
ssm / recurrent-layer / M-RoPE / expert keys) and an independent reader that undoes llama.cpp's layout (value heads
tiled, A = -exp(A_log), norms as 1 + w, experts merged) and runs transformers' Qwen3.5 on what it read. llama.cpp's own
converter writes the same tensors bit for bit (benchmarks/gguf_vs_converter.py)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import runtime_logprobs
from test_export_gguf import BLOCK_BYTES, GGML_TYPE_ID, TOKENS, _bf16_with_a_merge, _field, gguf_file, reader_logprobs

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.targets import BuildOptions, build_engine

gguf = pytest.importorskip("gguf")

# 2 key heads of 32 read by 4 value heads of 32 (each key head's two value heads move apart in llama.cpp's order), a
# DeltaNet layer then a full-attention one with 4 heads of 32 (gated q_proj, a rotary embedding over 8 of 32)
CONFIG = dict(model_type="qwen3_5_text", hidden_size=64, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              layer_types=["linear_attention", "full_attention"])
# the same layers with 4 experts of 64 (2 a token) and a shared expert of 96 (three Q4_0 blocks a row) for every MLP
CONFIG_MOE = CONFIG | dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, shared_expert_intermediate_size=96)
SCHEMES = {"bf16": (None, "BF16"), "w4-g32": (dict(bits=4, group_size=32), "Q4_0"),
           "w8-g32": (dict(bits=8, group_size=32), "Q8_0")}


@pytest.fixture(scope="module", params=[CONFIG, CONFIG_MOE], ids=["qwen35", "qwen35moe"])
def hybrid(tmp_path_factory, request):
    from helpers import make_tiny_model
    from test_export_gguf import _bf16

    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("qwen35")
    store = Store(root / "store")
    d = make_tiny_model(root / "hf", seed=7, **request.param)
    _bf16(d, random_norms=True)   # (1 + w) norms and the DeltaNet's w-norm: every value matters
    model = resolve_model(str(_bf16_with_a_merge(d)), store)
    built = {}
    for scheme, (qopts, _) in SCHEMES.items():
        src = model if qopts is None else quantize(model, QuantizeOptions(method="rtn", **qopts), store,
                                                   progress=False)
        built[scheme] = (src, build_engine(src, store, BuildOptions(target="gguf")))
    return store, built


def expected_tensors(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, ne0 first; kind) as llama.cpp's qwen35 / qwen35moe loader creates them for this config."""
    e, v, d = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    kh, vh, dk = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"]
    conv = 2 * kh * dk + vh * dk
    out = {"token_embd.weight": ((e, v), "embed"), "output_norm.weight": ((e,), "f32"),
           "output.weight": ((e, v), "lm_head")}
    for i, kind in enumerate(c["layer_types"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": ((e,), "f32"), b + "post_attention_norm.weight": ((e,), "f32")}
        if "num_experts" in c:   # the router and shared expert gate F32, each role's experts one 3-D tensor
            n, f, fs = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
            out |= {b + "ffn_gate_inp.weight": ((e, n), "f32"), b + "ffn_gate_exps.weight": ((e, f, n), "linear"),
                    b + "ffn_up_exps.weight": ((e, f, n), "linear"), b + "ffn_down_exps.weight": ((f, e, n), "linear"),
                    b + "ffn_gate_inp_shexp.weight": ((e, 1), "f32"), b + "ffn_gate_shexp.weight": ((e, fs), "linear"),
                    b + "ffn_up_shexp.weight": ((e, fs), "linear"), b + "ffn_down_shexp.weight": ((fs, e), "linear")}
        else:
            f = c["intermediate_size"]
            out |= {b + "ffn_gate.weight": ((e, f), "linear"), b + "ffn_up.weight": ((e, f), "linear"),
                    b + "ffn_down.weight": ((f, e), "linear")}
        if kind == "full_attention":   # q_proj holds each head's query and its output gate
            out |= {b + "attn_q.weight": ((e, 2 * q), "linear"), b + "attn_k.weight": ((e, kv), "linear"),
                    b + "attn_v.weight": ((e, kv), "linear"), b + "attn_output.weight": ((q, e), "linear"),
                    b + "attn_q_norm.weight": ((d,), "f32"), b + "attn_k_norm.weight": ((d,), "f32")}
        else:
            out |= {b + "attn_qkv.weight": ((e, conv), "linear"), b + "attn_gate.weight": ((e, vh * dk), "linear"),
                    b + "ssm_conv1d.weight": ((c["linear_conv_kernel_dim"], conv), "f32"),
                    b + "ssm_dt.bias": ((vh,), "f32"), b + "ssm_a": ((vh,), "f32"),
                    b + "ssm_beta.weight": ((e, vh), "embed"), b + "ssm_alpha.weight": ((e, vh), "embed"),
                    b + "ssm_norm.weight": ((dk,), "f32"), b + "ssm_out.weight": ((vh * dk, e), "linear")}
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qwen35_file_meets_llama_cpp_loader_contract(hybrid, scheme):
    _, built = hybrid
    src, art = built[scheme]
    c = json.loads((src.path / "config.json").read_text())
    r = gguf.GGUFReader(gguf_file(art))
    name = "qwen35moe" if "num_experts" in c else "qwen35"
    assert _field(r, "general.architecture")[1] == name
    want = {"ssm.conv_kernel": c["linear_conv_kernel_dim"], "ssm.state_size": 32, "ssm.group_count": 2,
            "ssm.time_step_rank": 4, "ssm.inner_size": 128, "rope.dimension_count": 8,   # a quarter of 32
            "attention.key_length": 32, "attention.value_length": 32,
            "attention.recurrent_layers": [True, False], "rope.dimension_sections": [11, 11, 10, 0]}
    if "num_experts" in c:
        want |= {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 64,
                 "expert_shared_feed_forward_length": 96}
        assert f"{name}.feed_forward_length" not in r.fields   # no dense MLP
    for k, v in want.items():
        assert _field(r, f"{name}.{k}")[1] == v, k
    tensors = {t.name: t for t in r.tensors}
    expected = expected_tensors(c)
    assert set(tensors) == set(expected)
    linear = SCHEMES[scheme][1]
    for name, (shape, kind) in expected.items():
        typ = {"f32": "F32", "embed": "BF16", "lm_head": "BF16", "linear": linear}[kind]
        t = tensors[name]
        assert t.tensor_type == GGML_TYPE_ID[typ], name
        assert tuple(int(x) for x in t.shape) == shape, name
        per_block, nbytes = BLOCK_BYTES[typ]
        assert t.n_bytes == int(torch.tensor(shape).prod()) // per_block * nbytes, name


def _untiled(x: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """llama.cpp's tiled value heads (k0, k1, k0, k1: 2 key heads, 4 value heads) back to Hugging Face's grouped
    order (k0's two, then k1's), along `dim` in heads of `width`."""
    heads = x.shape[dim] // width
    x = x.movedim(dim, 0).reshape(2, heads // 2, width, *x.shape[:dim], *x.shape[dim + 1:])
    return x.transpose(0, 1).reshape(heads * width, *x.shape[3:]).movedim(0, dim)


def read_qwen35(path):
    """transformers' Qwen3.5 (dense or MoE) from the GGUF file alone, as llama.cpp reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    g = lambda k: r.fields[f"{arch}.{k}"].contents()  # noqa: E731
    recurrent = g("attention.recurrent_layers")
    mlp = dict(num_experts=g("expert_count"), num_experts_per_tok=g("expert_used_count"),
               moe_intermediate_size=g("expert_feed_forward_length"),
               shared_expert_intermediate_size=g("expert_shared_feed_forward_length")) if arch == "qwen35moe" else \
        dict(intermediate_size=g("feed_forward_length"))
    cfg = AutoConfig.for_model(
        "qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text",
        vocab_size=len(r.fields["tokenizer.ggml.tokens"].contents()), hidden_size=g("embedding_length"), **mlp,
        num_hidden_layers=g("block_count"), num_attention_heads=g("attention.head_count"),
        num_key_value_heads=g("attention.head_count_kv"), head_dim=g("attention.key_length"),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon"), tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": g("rope.freq_base"),
                         "partial_rotary_factor": g("rope.dimension_count") / g("attention.key_length")},
        linear_num_key_heads=g("ssm.group_count"), linear_num_value_heads=g("ssm.time_step_rank"),
        linear_key_head_dim=g("ssm.state_size"), linear_value_head_dim=g("ssm.state_size"),
        linear_conv_kernel_dim=g("ssm.conv_kernel"),
        layer_types=["linear_attention" if x else "full_attention" for x in recurrent])
    d, qk = cfg.linear_value_head_dim, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight":
             "post_attention_layernorm.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_q.weight": "self_attn.q_proj.weight",
             "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
             "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
             "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
             "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
             "ssm_out.weight": "linear_attn.out_proj.weight", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
             "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
             "ssm_norm.weight": "linear_attn.norm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
             "ffn_down_exps.weight": "mlp.experts.down_proj", "ffn_gate_inp_shexp.weight":
             "mlp.shared_expert_gate.weight", "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
             "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
             "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
    state, gates = {}, {}
    for t in r.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(x) for x in reversed(t.shape)]).astype("float32"))
        if t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            key = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                   "output_norm.weight": "model.norm.weight"}[t.name]
            state[key] = w - 1 if t.name == "output_norm.weight" else w
            continue
        _, i, rest = t.name.split(".", 2)
        if rest.endswith("norm.weight") and rest != "ssm_norm.weight":
            w = w - 1   # llama.cpp multiplies by the stored weight, Qwen3.5 by 1 + w
        if rest == "attn_qkv.weight":
            w = torch.cat([w[:qk], _untiled(w[qk:], 0, d)])
        elif rest == "ssm_conv1d.weight":
            w = torch.cat([w[:qk], _untiled(w[qk:], 0, d)])[:, None, :]
        elif rest in ("attn_gate.weight",):
            w = _untiled(w, 0, d)
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
            w = _untiled(w, 0, 1)
        elif rest == "ssm_a":
            w = _untiled((-w).log(), 0, 1)
        elif rest == "ssm_out.weight":
            w = _untiled(w, 1, d)
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):   # transformers holds them as one, gate first
            gates.setdefault(i, {})[rest] = w
            if len(gates[i]) == 2:
                state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
                    [gates[i]["ffn_gate_exps.weight"], gates[i]["ffn_up_exps.weight"]], dim=1)
            continue
        state[f"model.layers.{i}.{names[rest]}"] = w
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qwen35_reader_reproduces_llmq_runtime_logits(hybrid, scheme):
    """What llama.cpp reads from the file computes what llmq's runtime computes on the artifact (the runtime's INT4 /
    INT8 kernels take bf16 activations: KLD 1e-3; the file is exact against transformers over the artifact's own
    dequantized weights, below)."""
    from test_export_gguf import exact_artifact_model

    _, built = hybrid
    src, art = built[scheme]
    got = reader_logprobs(read_qwen35(gguf_file(art)), TOKENS)
    assert kld_top1(runtime_logprobs(src.path, TOKENS), got)["kld_mean"] <= 1e-3
    assert kld_top1(reader_logprobs(exact_artifact_model(src.path), TOKENS), got)["kld_mean"] <= 1e-6


def test_qwen35_reader_would_catch_value_heads_left_grouped(hybrid, monkeypatch):
    """The bound has teeth: a file whose value heads stayed in Hugging Face's grouped order, read as llama.cpp reads
    it, is far from the model."""
    import llmq.pipeline.targets.gguf_linear_attention as la

    store, built = hybrid
    src, _ = built["bf16"]
    monkeypatch.setattr(la, "tiled", lambda k, per, width: torch.arange(k * per * width))
    grouped = build_engine(src, store, BuildOptions(target="gguf", name="grouped"))
    got = reader_logprobs(read_qwen35(gguf_file(grouped)), TOKENS)
    assert kld_top1(runtime_logprobs(src.path, TOKENS), got)["kld_mean"] > 1e-3


@pytest.mark.parametrize("override,words", [
    (dict(linear_value_head_dim=16), "one head width for keys and values"),
    (dict(head_dim=16, hidden_size=64), "needs heads of at least 32")])
def test_what_qwen35_cannot_hold_is_refused_in_one_line(hybrid, tmp_path, override, words):
    from helpers import make_tiny_model

    store, _ = hybrid
    src = resolve_model(str(make_tiny_model(tmp_path / "m", **{**CONFIG, **override})), store)
    with pytest.raises(LlmqError, match=words) as e:
        build_engine(src, store, BuildOptions(target="gguf"))
    assert "\n" not in str(e.value)


def test_hybrid_trtllm_target_is_still_refused_in_one_line(hybrid):
    store, built = hybrid
    src, _ = built["bf16"]
    with pytest.raises(LlmqError, match="Gated DeltaNet layers yet.*--target llmq or gguf") as e:
        build_engine(src, store, BuildOptions(target="trtllm"))
    assert "\n" not in str(e.value)
