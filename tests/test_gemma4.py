"""Gemma 4 text models (`Gemma4ForCausalLM`) in llmq's runtime against transformers 5.23 in float32: global layers of
their own head width (and KV heads, their values being their keys), a proportional rotary table, the last layers
reading earlier layers' KV caches with double-wide MLPs, per-layer inputs, norms that multiply by w, values
normalized without a weight and a scalar on each layer's output; through chunked prefill past the window, batched
decodes, prefix-cache hits and speculative rollback. The stages that do not take it yet refuse it in one line.
(tests/test_families.py runs the registry's tiny Gemma 4 too.)"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import Oracle, assert_refused_in_one_line, bf16_store, family_config, hf_model, make_tiny_model

from llmq.errors import LlmqError
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
# the registry's (shared KV caches, double-wide MLPs, per-layer inputs), and one whose global layers have 1 KV head
# whose values are its keys (no v_proj), without sharing or per-layer inputs
SHARED = family_config("gemma4_text") | dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 2 +
                                             ["full_attention", "sliding_attention", "sliding_attention",
                                              "full_attention"])
K_EQ_V = family_config("gemma4_text") | dict(attention_k_eq_v=True, num_global_key_value_heads=1,
                                             num_kv_shared_layers=0, use_double_wide_mlp=False,
                                             hidden_size_per_layer_input=0)


@pytest.fixture(scope="module", params=[SHARED, K_EQ_V], ids=["shared-kv-ple", "k-eq-v"])
def model(tmp_path_factory, request):
    """The tiny Gemma 4 with its norm weights and layer scalars drawn at random (transformers initialises them to
    one), so that each must be computed."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path_factory.mktemp("gemma4") / "g", seed=4, **request.param)
    f = next(path.glob("*.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({k: 1 + 0.5 * torch.randn(v.shape, generator=g) if k.endswith(("norm.weight", "layer_scalar")) else v
               for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return path


def _kld(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).max())


def test_runtime_equals_transformers_past_the_window_with_shared_caches(model):
    """16-token chunks over 40 tokens (the window is 8): later chunks read producers' caches through block tables;
    three prompts decode together; a repeated prompt hits the prefix cache."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 17)]
    hf = hf_model(model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        want = [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = LLMEngine(model, EngineConfig(max_model_len=128, block_size=4, kv_cache_memory=32 << 20,
                                        max_num_batched_tokens=16))
    try:
        got = eng.prompt_logprobs(ids).double()
        out = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        again = [o.output_token_ids for o in eng.generate(prompts[1:], GREEDY)]
        assert eng.stats().prefix_cache_hits > 0
    finally:
        eng.shutdown()
    assert _kld(ref, got) <= 1e-6
    assert out == want
    assert again == want[1:]


def test_the_spec_counts_every_parameter_the_checkpoint_holds(model):
    """ModelSpec.num_parameters (what deploy sizes with) per layer: global heads, missing k / v, double-wide MLPs,
    per-layer inputs."""
    from safetensors.torch import load_file

    from llmq.models.spec import ModelSpec

    stored = sum(t.numel() for f in model.glob("*.safetensors") for t in load_file(f).values())
    assert ModelSpec.from_config(model).num_parameters() == stored


def test_the_model_specific_parts_are_computed_not_ignored(model, tmp_path):
    """Each Gemma 4 part changed in the checkpoint changes transformers' logits, and llmq's equally: the layer
    scalars, the values' normalization source (the global layers' keys, or v_proj), the per-layer inputs' table."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((model / "config.json").read_text())
    ids = list(range(40, 80))
    changed = shutil.copytree(model, tmp_path / "changed")
    f = next(changed.glob("*.safetensors"))
    st = load_file(f)
    st["model.layers.1.layer_scalar"] = st["model.layers.1.layer_scalar"] * 3
    key = "model.embed_tokens_per_layer.weight" if cfg["hidden_size_per_layer_input"] else \
        "model.layers.1.self_attn.k_proj.weight"   # k_eq_v: the global layer's values are these keys
    st[key] = st[key].flip(0)
    save_file(st, f, metadata={"format": "pt"})
    with torch.no_grad():
        before = hf_model(model)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        ref = hf_model(changed)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    eng = LLMEngine(changed, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20))
    try:
        got = eng.prompt_logprobs(ids).double()
    finally:
        eng.shutdown()
    assert _kld(ref, before) > 1e-3
    assert _kld(ref, got) <= 1e-6


def test_speculation_rolls_back_the_shared_caches(model):
    """Drafts wrong at every position: the layers reading an earlier layer's cache read only kept tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = dict(max_model_len=64, block_size=4, max_num_batched_tokens=32, kv_cache_memory=8 << 20)
    eng = LLMEngine(model, EngineConfig(**plain))
    ref = [o.output_token_ids for o in eng.generate(prompts, params)]
    eng.shutdown()
    eng = LLMEngine(model, EngineConfig(**plain, speculative="ngram", speculative_max_batch=None,
                                        num_speculative_tokens=4))
    eng.speculator.proposer = Oracle({tuple(p): r for p, r in zip(prompts, ref)})
    try:
        assert [o.output_token_ids for o in eng.generate(prompts, params)] == ref
        st = eng.speculator.stats
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def bf16(model, tmp_path_factory):
    """The model in bfloat16 (how checkpoints ship) in a store of its own."""
    return bf16_store(model, tmp_path_factory.mktemp("gemma4-store"))


def test_rtn_gemma4_runs_as_its_probe_measured_and_as_transformers_loads_it(bf16, monkeypatch, tmp_path):
    """The layer-by-layer pass carries each layer's per-layer input and the shared keys and values in its streams
    (layer_inputs): what llmq's runtime computes from the artifact is what the quantize probe measured (capped
    logits, as the model caps them), and transformers loading the artifact (decompressed) computes it too; the
    per-layer input linears stay 16-bit."""
    _check_quantized(bf16, dict(method="rtn", bits=4, group_size=16), monkeypatch, tmp_path)


@pytest.mark.parametrize("model", [SHARED], indirect=True, ids=["shared-kv-ple"])
def test_gptq_gemma4_calibrates_through_the_shared_caches(bf16, monkeypatch, tmp_path):
    """GPTQ's calibration streams carry the per-layer inputs and shared keys and values too: the same checks."""
    _check_quantized(bf16, dict(method="gptq", bits=4, group_size=16), monkeypatch, tmp_path)


def _check_quantized(bf16, method: dict, monkeypatch, tmp_path) -> None:
    from helpers import bf16_kernels_off, decompressed_dense, runtime_logprobs, runtime_probe_kld

    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = bf16
    art = quantize(src, QuantizeOptions(num_samples=4, seq_len=64, probe_tokens=128, **method), store, progress=False)
    ignore = json.loads((art.path / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.per_layer_input_gate" in ignore or not json.loads(
        (src.path / "config.json").read_text())["hidden_size_per_layer_input"]
    recorded = art.metrics["probe"]["kld_mean"]
    assert recorded > 1e-4
    assert abs(runtime_probe_kld(src.path, art.path, 128) / recorded - 1) < 2e-2
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf_model(decompressed_dense(art, tmp_path / "dense"))(torch.tensor([ids])).logits[0].double()
    bf16_kernels_off(monkeypatch)
    assert _kld(ref.log_softmax(-1), runtime_logprobs(art.path, ids, max_model_len=64).double()) <= 1e-5


def test_quantize_kv_calibrates_the_caches_kept_and_the_sharing_layers_read_them(bf16):
    """INT8 per-head KV scales for the layers keeping a cache, each with its own KV heads (a global layer's may
    differ), none for the layers reading an earlier one's; the artifact serves with them (its held-out KLD against
    the 16-bit cache measured, small, not zero), and so do the sharing layers, through their producers' scales."""
    from safetensors import safe_open

    from llmq.models.spec import ModelSpec
    from llmq.pipeline.kvcache import KVOptions, quantize_kv

    store, src = bf16
    spec = ModelSpec.from_config(src.path)
    art = quantize_kv(src, store, KVOptions(kv="int8", granularity="head", num_samples=4, seq_len=64,
                                            probe_tokens=128), show_progress=False)
    found = {}
    for f in art.path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            found |= {k: math.prod(h.get_slice(k).get_shape()) for k in h.keys() if k.endswith(("k_scale", "v_scale"))}
    assert found == {f"model.layers.{i}.self_attn.{t}_scale": spec.kv_heads_of(i)   # one per head
                     for i in spec.kv_layers() for t in "kv"}
    assert 0 < art.metrics["probe"]["kld_mean"] < 0.02
    eng = LLMEngine(art.path, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    try:
        assert eng.runner.caches[spec.num_layers - 1].kv_dtype == "int8"
        assert [o.output_token_ids for o in eng.generate([[5, 6, 7]], GREEDY)][0]
    finally:
        eng.shutdown()


def test_what_does_not_take_gemma4_yet_is_refused_in_one_line(bf16):
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src = bf16
    calls = [(lambda: quantize(src, QuantizeOptions(method="awq", bits=4), store, progress=False), "awq"),
             (lambda: quantize(src, QuantizeOptions(method="rtn", bits=4, target_bpw=5.0), store, progress=False),
              "mixed precision"),
             (lambda: quantize(src, QuantizeOptions(method="rtn", bits=4, rotate="hadamard"), store,
                               progress=False), "--rotate"),
             (lambda: build_engine(src, store, BuildOptions(target="gguf")), "build"),
             (lambda: LLMEngine(src.path, EngineConfig(compile=True, kv_cache_memory=8 << 20)), "--compile")]
    assert_refused_in_one_line(store, calls)


@pytest.mark.parametrize("change,words", [
    (lambda cfg, st: st.pop("model.layers.1.self_attn.q_norm.weight"), "model.layers.1.self_attn.q_norm.weight"),
    (lambda cfg, st: st.pop("model.per_layer_model_projection.weight"), "model.per_layer_model_projection.weight"),
    (lambda cfg, st: cfg.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
     "enable_moe_block"),
], ids=["missing-q-norm", "missing-per-layer-projection", "moe-block"])
def test_a_bad_gemma4_checkpoint_is_refused_naming_the_field_or_tensor(tmp_path, change, words):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path / "g", seed=4, **family_config("gemma4_text"))
    f = next(path.glob("*.safetensors"))
    cfg, st = json.loads((path / "config.json").read_text()), load_file(f)
    change(cfg, st)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(st, f, metadata={"format": "pt"})
    with pytest.raises(LlmqError, match=words) as e:
        LLMEngine(path, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    """(store, artifact) of a tiny Gemma4ForConditionalGeneration in bfloat16: the registry's text model, a one-layer
    vision tower beside it (no audio tower)."""
    import transformers
    from helpers import byte_tokenizer

    tok = byte_tokenizer()
    text = {k: v for k, v in family_config("gemma4_text").items() if k != "model_type"} | dict(
        vocab_size=320, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True,
        initializer_range=0.1)
    config = transformers.Gemma4Config(
        text_config=text, audio_config=None, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    torch.manual_seed(4)
    d = tmp_path_factory.mktemp("gemma4-vl")
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(d / "f32")
    tok.save_pretrained(d / "f32")
    return bf16_store(d / "f32", d)


def test_a_conditional_checkpoint_serves_its_text_and_quantizes_its_language_model(conditional):
    """Gemma 4 as its releases ship (Gemma4ForConditionalGeneration): llmq runs its language model (transformers'
    conditional model's text logits), refuses an image in one line (the towers are carried, not run), and quantizes
    the language model with the vision tower and its embedder as stored and in `ignore`; the artifact computes what
    its probe measured."""
    import transformers
    from helpers import runtime_logprobs, runtime_probe_kld

    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = conditional
    ids = list(range(40, 80))
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(src.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    assert _kld(ref, runtime_logprobs(src.path, ids, max_model_len=128).double()) <= 1e-6
    eng = LLMEngine(src.path, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    try:
        with pytest.raises(LlmqError, match="takes no images: llmq carries Gemma 4's vision and audio towers"):
            eng.add_request("r", [1, 2, 3], GREEDY, images=torch.zeros(1, 3, 8, 8))
    finally:
        eng.shutdown()
    q = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=16, num_samples=2, seq_len=32,
                                      probe_tokens=128), store, progress=False)
    cfg = json.loads((q.path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert {"re:.*vision_tower.*", "re:.*embed_vision.*"} <= set(cfg["quantization_config"]["ignore"])
    r, s = CheckpointReader(q.path), CheckpointReader(src.path)
    assert r.layer_linears(0)["q_proj"].qw is not None
    assert any(n.startswith("model.embed_vision.") for n in s.tensors.vision)
    assert sorted(r.tensors.vision) == sorted(s.tensors.vision)
    assert all(torch.equal(r.tensors.vision_tensor(n), s.tensors.vision_tensor(n)) for n in s.tensors.vision)
    recorded = q.metrics["probe"]["kld_mean"]
    assert abs(runtime_probe_kld(src.path, q.path, 128) / recorded - 1) < 2e-2
    kv = quantize_kv(q, store, KVOptions(kv="int8", num_samples=2, seq_len=32, probe_tokens=64), show_progress=False)
    assert 0 < kv.metrics["probe"]["kld_mean"] < 0.02
    kv_ckpt = CheckpointReader(kv.path)   # scales stored in the conditional layout, read through the text view
    assert kv_ckpt.tensors.stored_name("model.layers.0.self_attn.k_scale") == \
        "model.language_model.layers.0.self_attn.k_scale"
    assert kv_ckpt.kv_scales(0) is not None
