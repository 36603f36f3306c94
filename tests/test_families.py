"""Every architecture family llmq declares (llmq.models.arch) against transformers: the declaration names exactly the
checkpoint's tensors, and the runtime computes transformers' forward at tp 1 and 2 (float32: KLD at rounding level,
the same greedy continuations). Per-stage contracts per family live with each stage's tests (quantize methods and KV
schemes: test_export_compressed_tensors; exports: test_export_gguf, test_export_trtllm_hf)."""

from __future__ import annotations

import pytest
import torch

from llmq.errors import LlmqError
from llmq.models.arch import ARCHS
from llmq.models.spec import ModelSpec
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

# family -> config overrides that exercise what it declares (biases, tied tables, head_dim != hidden / heads)
FAMILIES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {"tie_word_embeddings": True},
            "qwen3": {"head_dim": 24},
            # local layers slide over 8 of the 40 scored tokens with their own rotary base, beside a global one
            "gemma3_text": {"head_dim": 24, "sliding_window": 8, "query_pre_attn_scalar": 20,
                            "final_logit_softcapping": 5.0, "layer_types": ["sliding_attention", "full_attention"]},
            # 8 experts of width 32, 2 a token (renormalized in one family, not in the other)
            "qwen3_moe": {"head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "norm_topk_prob": False},
            "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_every_declared_family_is_tested():
    assert set(FAMILIES) == set(ARCHS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from helpers import make_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {t: make_tiny_model(root / t, seed=4, model_type=t, num_attention_heads=6, num_key_value_heads=2,
                               hidden_size=96, **kw) for t, kw in FAMILIES.items()}


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
        declared |= {f"{n}.weight" for n in arch.linear_names(i, spec.num_experts)} | \
            {arch.norm(i, r) for r in arch.norms}
        if spec.attention_bias:
            declared |= {f"{arch.linear(i, r)}.bias" for r in ("q_proj", "k_proj", "v_proj")}
    assert set(ckpt.tensors) == declared
    for i in range(spec.num_layers):  # and every declared linear has the shape the spec says
        assert {r: ckpt.tensors.info(arch.linear(i, r) + ".weight")[1] for r in spec.roles()} == \
            {r: list(spec.linear_shape(r)) for r in spec.roles()}


def _transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_runtime_equals_transformers(models, family, tp):
    path = models[family]
    gen = torch.Generator().manual_seed(tp)
    ids = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23)]
    hf = _transformers(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        want = [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # chunked prefill: later chunks read their window of the cache through block tables
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
        ref = _transformers(d)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        plain = _transformers(models["qwen3"])(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    got = LLMEngine(d, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20)).prompt_logprobs(ids).double()
    assert float((ref.exp() * (ref - plain)).sum(-1).mean()) > 1e-3   # the norms matter
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) <= 1e-6


def test_an_undeclared_family_is_refused_naming_the_supported_ones():
    with pytest.raises(LlmqError,
                       match=r"^unsupported architecture 'Phi3ForCausalLM' .*Gemma3ForCausalLM \(gemma3_text\)"):
        ModelSpec.from_config({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]})


def test_legacy_trtllm_checkpoint_refuses_qwen3_in_one_line(models, store):
    from llmq.models import resolve_model
    from llmq.pipeline.targets import BuildOptions, build_engine

    src = resolve_model(str(models["qwen3"]), store)
    with pytest.raises(LlmqError, match=r"^--target trtllm writes the legacy .* not Qwen3ForCausalLM; use --target "
                                        r"trtllm-hf"):
        build_engine(src, store, BuildOptions(target="trtllm"))

