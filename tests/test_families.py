"""Every architecture family llmq declares (llmq.models.arch) against transformers: the declaration names exactly the
checkpoint's tensors, and the runtime computes transformers' forward at tp 1 and 2 (float32: KLD at rounding level,
the same greedy continuations). Per-stage contracts per family live with each stage's tests (quantize methods and KV
schemes: test_export_compressed_tensors; exports: test_export_gguf, test_export_trtllm)."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, hf_model

from llmq.errors import LlmqError
from llmq.models.arch import ARCHS, ATTN, ROUTER
from llmq.models.spec import ModelSpec
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_every_declared_family_is_tested():
    assert set(FAMILIES) == set(ARCHS)


@pytest.fixture(scope="module")
def models(family_dir):
    return {t: family_dir(t) for t in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_declaration_names_exactly_the_checkpoint_tensors(models, family):
    from llmq.models import qformat
    from llmq.models.reader import CheckpointReader

    ckpt = CheckpointReader(models[family])
    arch, spec = ckpt.arch, ckpt.spec
    declared = {f"{qformat.EMBEDDING}.weight", f"{arch.final_norm}.weight"}
    if not spec.tie_word_embeddings:
        declared.add(f"{qformat.LM_HEAD}.weight")
    for i in range(spec.num_layers):
        declared |= {f"{arch.prefix(i)}.{p}.weight" for p in spec.stored_linears(i).values()} | \
            {arch.norm(i, r) for r in spec.norm_roles(i)} | \
            {f"{arch.prefix(i)}.{p}" for p in (*spec.linear_tensors(i), *spec.stacked_experts())}
        if spec.attention_bias:   # Qwen2's o_proj has none; GPT-OSS's router has one
            declared |= {f"{arch.linear(i, r)}.bias" for r in (("q_proj", "k_proj", "v_proj") if family == "qwen2"
                                                               else ATTN)}
        if family == "gpt_oss":
            declared.add(f"{arch.linear(i, ROUTER)}.bias")
    declared |= {f"{n}.weight" for n in ckpt.model_tensors()}   # Gemma 4's per-layer inputs
    assert set(ckpt.tensors) == declared
    for i in range(spec.num_layers):  # and every declared linear and tensor has the shape the spec says
        stored = spec.stored_linears(i)
        assert {n: ckpt.tensors.info(f"{arch.prefix(i)}.{p}.weight")[1] for n, p in stored.items()} == \
            {n: list(spec.linear_shape(n, i)) for n in stored}
        assert {r: list(lw.shape) for r, lw in ckpt.layer_linears(i).items()} == \
            {r: list(spec.linear_shape(r, i)) for r in spec.roles(i)}
        others = spec.linear_tensors(i) | spec.stacked_experts()
        assert {p: ckpt.tensors.info(f"{arch.prefix(i)}.{p}")[1] for p in others} == \
            {p: list(shape) for p, shape in others.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_runtime_equals_transformers(models, family, tp):
    path = models[family]
    if tp == 2 and ARCHS[family].per_layer_heads:   # Gemma 4: refused in one line
        with pytest.raises(LlmqError, match="--tp does not take its per-layer head widths") as e:
            LLMEngine(path, EngineConfig(tp=tp, max_model_len=128, kv_cache_memory=32 << 20))
        assert "\n" not in str(e.value)
        return
    gen = torch.Generator().manual_seed(tp)
    ids = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23)]
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        want = [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # chunked prefill: later chunks read their window of the cache through block tables (and resume recurrent
    # states: a Gated DeltaNet's at tp 2 split by value heads)
    eng = LLMEngine(path, EngineConfig(tp=tp, max_model_len=128, kv_cache_memory=32 << 20, max_num_batched_tokens=16))
    try:
        got = eng.prompt_logprobs(ids).double()
        out = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
    finally:
        eng.shutdown()
    kld = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kld <= 1e-6, kld
    assert out == want


def test_qwen3_q_k_norms_are_computed_not_ignored(models, tmp_path):
    """A Qwen3 whose q/k norm weights are scaled gives different logits in both transformers and llmq, equally: the
    runtime reads and applies them (a runtime that dropped them would equal the unscaled model instead)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = shutil.copytree(models["qwen3"], tmp_path / "scaled")
    f = next(d.glob("*.safetensors"))
    st = load_file(f)
    for k in st:
        if k.endswith(("q_norm.weight", "k_norm.weight")):
            st[k] = st[k] * torch.linspace(0.2, 3.0, st[k].numel())
    save_file(st, f, metadata={"format": "pt"})
    ids = list(range(40, 80))
    with torch.no_grad():
        ref = hf_model(d)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        plain = hf_model(models["qwen3"])(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    got = LLMEngine(d, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20)).prompt_logprobs(ids).double()
    assert float((ref.exp() * (ref - plain)).sum(-1).mean()) > 1e-3   # the norms matter
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) <= 1e-6


def test_smollm3_nope_layers_are_computed_not_ignored(models, tmp_path):
    """The same SmolLM3 weights with every layer rotating give other logits in transformers; llmq follows
    no_rope_layers (a runtime that rotated every layer would equal that model instead), in prefill and in decode
    (whose fused CPU layers run the NoPE layer apart)."""
    import json
    import shutil

    d = shutil.copytree(models["smollm3"], tmp_path / "all-rope")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["no_rope_layers"] == [1, 1, 1, 0]
    (d / "config.json").write_text(json.dumps(cfg | {"no_rope_layers": [1, 1, 1, 1]}))
    ids = list(range(40, 80))
    with torch.no_grad():
        ref = hf_model(models["smollm3"])(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        roped = hf_model(d)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    eng = LLMEngine(models["smollm3"], EngineConfig(max_model_len=128, kv_cache_memory=32 << 20))
    try:
        got = eng.prompt_logprobs(ids).double()
        out = eng.generate([ids[:8]], GREEDY)[0].output_token_ids
    finally:
        eng.shutdown()
    assert float((ref.exp() * (ref - roped)).sum(-1).mean()) > 1e-3   # NoPE matters
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) <= 1e-6
    with torch.no_grad():
        want = hf_model(models["smollm3"]).generate(torch.tensor([ids[:8]]), max_new_tokens=GREEDY.max_tokens,
                                                    do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert out == want


def test_an_undeclared_family_is_refused_naming_the_supported_ones():
    with pytest.raises(LlmqError,
                       match=r"^unsupported architecture 'Olmo2ForCausalLM' .*Phi3ForCausalLM \(phi3\)"):
        ModelSpec.from_config({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]})


# groups of 16: a rank's o_proj input (3 heads of 16 at tp 2) must split on group edges whichever units get 4 bits
# (float32 scales: 6 bits a weight at 4 bits, so 7 leaves room for some at 8)
@pytest.mark.parametrize("quant", [dict(method="rtn", bits=4, group_size=16, target_bpw=7),
                                   dict(method="fp8", bits=8, activations="static", per_tensor=True)],
                         ids=["rtn-mixed", "fp8-static-tensor"])
def test_phi3_fused_groups_are_cut_into_roles_for_llmq_rank_directories(models, store, quant):
    """A quantized Phi-3 stores qkv_proj / gate_up_proj fused (mixed precision names the groups; FP8 per tensor has
    one scale and one input scale for the group); `build --target llmq --tp 2` writes each rank's q / k / v and
    gate / up apart, names them so in its quantization config, and the shards compute the unsharded model."""
    from llmq.models import resolve_model
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    src = resolve_model(str(models["phi3"]), store)
    art = quantize(src, QuantizeOptions(num_samples=4, seq_len=32, probe_tokens=0, **quant), store, progress=False)
    stored = CheckpointReader(art.path)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" in stored.tensors
    if "target_bpw" in quant:  # the groups get different widths: named in the config by their stored names
        assert len({u["bits"] for u in art.config["mixed_precision"]["units"]}) > 1
    eng = build_engine(art, store, BuildOptions(tp=2, target="llmq", verify=True))
    assert eng.metrics["verify"]["passed"]
    rank = CheckpointReader(eng.path / "rank0")
    names = {k.rsplit(".", 1)[0] for k in rank.tensors if k.startswith("model.layers.0.")}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"} <= names
    assert not {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} & names
    for role, lw in rank.layer_linears(0).items():  # each role read with the scheme the group was stored with
        group = "qkv_proj" if role in ("q_proj", "k_proj", "v_proj") else \
            "gate_up_proj" if role in ("gate_proj", "up_proj") else role
        want = stored.linear(f"model.layers.0.{stored.arch.path(group)}").qw
        assert (lw.qw.scheme, lw.qw.bits) == (want.scheme, want.bits) if want is not None else lw.qw is None, role


@pytest.mark.parametrize("method", ["bnb-nf4", "bnb-int8"])
def test_phi3_bitsandbytes_is_refused_in_one_line_before_any_work(models, store, method):
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    src = resolve_model(str(models["phi3"]), store)
    bits = 4 if method == "bnb-nf4" else 8
    with pytest.raises(LlmqError, match=rf"^--method {method}: Phi3ForCausalLM stores qkv_proj, gate_up_proj fused "
                                        r"and llmq does not cut bitsandbytes packings [^\n]+$"):
        quantize(src, QuantizeOptions(method=method, bits=bits), store, progress=False)
    assert store.list(kind="quantized") == []
