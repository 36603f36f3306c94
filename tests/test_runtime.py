"""The runtime engine against Hugging Face transformers on tiny random models (and the default model)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import hf_greedy

from llmq.errors import LlmqError
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams, ScoreRequest

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def rand_prompts(lengths, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def reference(tiny):
    prompts = rand_prompts([5, 17, 40, 3, 64, 33, 90, 1], seed=1)
    return prompts, hf_greedy(tiny, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen2", "tie_word_embeddings": True},
                                       {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}])
def test_greedy_matches_transformers(tmp_path, make_tiny_model, overrides):
    d = make_tiny_model(tmp_path / "m", seed=3, **overrides)
    prompts = rand_prompts([7, 30, 2, 50], seed=2)
    eng = LLMEngine(d, EngineConfig(max_num_batched_tokens=24, block_size=8))
    got = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
    assert got == hf_greedy(d, prompts, GREEDY.max_tokens)


def test_concurrent_equals_one_at_a_time(tiny, reference):
    prompts, ref = reference
    eng = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=40, max_num_seqs=5, block_size=16))
    together = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
    alone = [eng.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    assert together == alone == ref
    # requests join a running batch at different steps and still give the same tokens
    outs = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == ref


def test_prefix_cache_hits_and_same_output(tiny):
    shared = rand_prompts([40], seed=5)[0]
    prompts = [shared + t for t in rand_prompts([3, 9, 20], seed=6)]
    cold = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False, block_size=8))
    ref = [o.output_token_ids for o in cold.generate(prompts, GREEDY)]
    assert cold.stats().prefix_cache_hits == 0
    eng = LLMEngine(tiny, EngineConfig(block_size=8))
    first = eng.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    rest = eng.generate(prompts[1:], GREEDY)
    assert [first.output_token_ids] + [o.output_token_ids for o in rest] == ref
    assert all(o.num_cached_tokens == 40 for o in rest)  # 5 full blocks of the shared prefix
    st = eng.stats()
    assert st.prefix_cache_hits == 80
    assert st.prefix_cache_queries == sum(map(len, prompts))
    assert st.kv_blocks_used == 0


def test_preemption_under_tiny_kv_budget(tiny, reference):
    prompts, ref = reference
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # K+V x layers x kv heads x head_dim x fp32 x block
    eng = LLMEngine(tiny, EngineConfig(kv_cache_memory=9 * block_bytes, max_num_batched_tokens=32, block_size=16,
                                       max_model_len=140))
    assert eng.num_blocks == 9
    got = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
    assert got == ref
    st = eng.stats()
    assert st.num_preemptions > 0
    assert st.kv_blocks_used == 0
    # prompt log-probabilities collected across chunks and preemptions, the first prompt's blocks in the prefix cache
    # (they must be computed again, for their logits), are the scorer's; the outputs are unchanged
    eng.generate([prompts[6]], GREEDY)
    order = [6, *range(len(prompts))]
    outs = eng.generate([prompts[i] for i in order], dataclasses.replace(GREEDY, prompt_logprobs=2))
    assert [o.output_token_ids for o in outs] == [ref[i] for i in order]
    assert eng.stats().num_preemptions > st.num_preemptions
    for p, o in zip([prompts[i] for i in order], outs):
        entries = o.prompt_logprobs.entries
        assert len(entries) == len(p) - 1
        assert all(len(e) in (2, 3) for e in entries)
        want = eng.prompt_logprobs(p)[:-1].gather(1, torch.tensor(p[1:], dtype=torch.long)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([e[t] for e, t in zip(entries, p[1:])]), want, atol=1e-5, rtol=0)


def test_blocks_return_to_zero_after_soak_with_aborts(tiny):
    rng = random.Random(0)
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, block_size=4,
                                       kv_cache_memory=2 * 2 * 2 * 16 * 4 * 4 * 40, max_model_len=128))
    live: set[str] = set()
    for i in range(300):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        eng.add_request(f"q{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.8, seed=i))
        live.add(f"q{i}")
        if rng.random() < 0.5:
            for o in eng.step():
                if o.finished:
                    live.discard(o.request_id)
        if rng.random() < 0.2 and live:
            victim = rng.choice(sorted(live))
            eng.abort_request(victim)
            live.discard(victim)
    while eng.has_unfinished():
        eng.step()
    st = eng.stats()
    assert st.kv_blocks_used == 0
    assert st.num_running == 0
    assert st.num_waiting == 0
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert st.num_preemptions > 0  # the budget was tight enough to exercise recompute too


def test_sampling_controls(tiny):
    eng = LLMEngine(tiny, EngineConfig())
    prompt = rand_prompts([12], seed=9)[0]
    # a seeded request samples the same tokens alone and inside a batch
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = eng.generate([prompt], sp)[0].output_token_ids
    batch = eng.generate([rand_prompts([20], seed=1)[0], prompt],
                         [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), sp])
    assert batch[1].output_token_ids == alone
    # top_k=1 is greedy whatever the temperature
    greedy = eng.generate([prompt], GREEDY)[0].output_token_ids
    assert eng.generate([prompt], SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=1,
                                                 ignore_eos=True))[0].output_token_ids == greedy
    # stop token ids end the request and stay in the token list but not in the text
    stop_tok = greedy[3]
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok],
                                                ignore_eos=True))[0]
    assert out.output_token_ids == greedy[:greedy.index(stop_tok) + 1]
    assert out.finish_reason == "stop"
    # stop strings cut the text
    full = eng.generate([prompt], GREEDY)[0].text
    if len(full) > 4:
        cut = full[2:4]
        out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[cut], ignore_eos=True))[0]
        assert out.finish_reason == "stop"
        assert out.text == full[:full.find(cut)]
    # logprobs: the sampled token's logprob and the top-N under the model's distribution
    out = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=5, ignore_eos=True))[0]
    lp = eng.prompt_logprobs(prompt + out.output_token_ids[:-1])
    for j, (tok, entry) in enumerate(zip(out.output_token_ids, out.new_logprobs)):
        row = lp[len(prompt) - 1 + j]
        assert int(row.argmax()) == tok
        assert len(entry) == 5
        assert entry[tok] == pytest.approx(float(row[tok]), abs=1e-4)
    assert out.finish_reason == "length"
    assert len(out.output_token_ids) == 3


def test_prompt_logprobs_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    ids = rand_prompts([70], seed=11)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    eng = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=16, block_size=8))
    got = eng.prompt_logprobs(ids)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-4, rtol=0)
    assert eng.stats().kv_blocks_used == 0
    assert eng.stats().prefix_cache_queries == 0


def test_score_reuses_shared_prefixes_and_matches_prompt_logprobs(tiny):
    """engine.score: the log-prob of each scored token, a shared prefix computed once, every block given back."""
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_num_batched_tokens=40, block_size=8))
    shared = rand_prompts([37], seed=21)[0]
    reqs = [ScoreRequest(shared + t, len(shared)) for t in rand_prompts([1, 5, 12, 30, 3, 9], seed=22)]
    reqs.append(ScoreRequest(rand_prompts([25], seed=23)[0], 1))
    finished = []
    outs = eng.score(reqs, progress=finished.append)
    assert sum(finished) == len(reqs)
    assert eng.stats().kv_blocks_used == 0
    for r, o in zip(reqs, outs):
        lsm = eng.prompt_logprobs(r.token_ids)[r.start - 1:-1]
        tgt = torch.tensor(r.token_ids[r.start:])
        assert torch.allclose(torch.tensor(o.logprobs), lsm.gather(1, tgt[:, None])[:, 0], atol=1e-5, rtol=0)
        assert o.greedy == (lsm.argmax(-1) == tgt).tolist()
    # the shared prompt's 4 full blocks before its last token: computed by one request, found cached by the other 5
    assert sorted(o.num_cached_tokens for o in outs) == [0, 0] + [32] * 5
    with pytest.raises(LlmqError, match="cannot score 3 tokens from 0"):
        eng.score([ScoreRequest([1, 2, 3], 0)])


def test_observe_kv_sees_every_cache_write_while_open(tiny):
    eng = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=16, block_size=8))
    seen = []
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with eng.observe_kv(lambda layer, k, v: seen.append((layer, k.shape, v.shape))):
        eng.generate(rand_prompts([20, 7], seed=5), params)
    # per layer: 27 prompt tokens, then the first 2 of each sequence's 3 generated tokens fed back
    shape = (eng.spec.num_kv_heads, eng.spec.head_dim)
    for layer in range(eng.spec.num_layers):
        assert sum(k[0] for i, k, _ in seen if i == layer) == 27 + 2 * 2
    assert all(k[1:] == v[1:] == shape for _, k, v in seen)
    n = len(seen)
    eng.generate(rand_prompts([9], seed=6), params)
    assert len(seen) == n  # closed: nothing observed any more


def test_bad_requests_raise_clear_errors(tiny):
    eng = LLMEngine(tiny, EngineConfig(max_model_len=64))
    with pytest.raises(LlmqError, match="context"):
        eng.add_request("a", list(range(64)), GREEDY)
    with pytest.raises(LlmqError, match="max_tokens"):
        eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=62))
    with pytest.raises(LlmqError, match="empty"):
        eng.add_request("c", [], GREEDY)
    with pytest.raises(LlmqError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(LlmqError, match="quantize-kv"):
        LLMEngine(tiny, EngineConfig(kv_cache_dtype="int8"))
    with pytest.raises(LlmqError, match="KV-cache budget"):
        LLMEngine(tiny, EngineConfig(kv_cache_memory=1024))
    with pytest.raises(LlmqError, match="^tp 3 is not supported"):   # the build stage's plan, the same refusal
        LLMEngine(tiny, EngineConfig(tp=3))
    eng.add_request("d", [1, 2, 3], GREEDY)
    with pytest.raises(LlmqError, match="in use"):
        eng.add_request("d", [1, 2, 3], GREEDY)


def test_weight_bytes_counts_every_stored_weight_once(tiny, store):
    """What MBU divides. A float checkpoint: its tensors' bytes but the embedding table (looked up, not read whole).
    Per-tensor INT8: q/k/v (and gate/up) cannot share one scale, so each group loads as a ConcatLinear of its parts,
    and the count must equal the stored linears loaded one by one, not add the group to its parts."""
    from safetensors.torch import load_file

    from llmq.models import resolve_model
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime.loader import ConcatLinear, build_linear

    def loaded(path):
        eng = LLMEngine(path, EngineConfig(kv_cache_memory=8 << 20))
        try:
            return eng.runner.model
        finally:
            eng.shutdown()

    stored = load_file(tiny / "model.safetensors")
    assert loaded(tiny).weight_bytes() == sum(t.numel() * t.element_size() for k, t in stored.items()
                                              if k != "model.embed_tokens.weight")  # float32, served in float32

    art = quantize(resolve_model(str(tiny), store), QuantizeOptions(method="rtn", bits=8, per_tensor=True,
                                                                    probe_tokens=0), store, progress=False)
    model, ck = loaded(art.path), CheckpointReader(art.path)
    assert any(isinstance(m, ConcatLinear) for m in model.modules())
    layers = range(ck.spec.num_layers)
    linears = [lw for i in layers for lw in ck.layer_linears(i).values()] + [ck.lm_head()]
    norms = [w for i in layers for w in ck.layer_norms(i).values()] + [ck.final_norm()]
    assert model.weight_bytes() == sum(build_linear([lw], torch.float32, "cpu").nbytes for lw in linears) + \
        sum(w.numel() * w.element_size() for w in norms)


def test_an_engine_built_for_another_target_is_refused(tiny, tmp_path):
    from llmq.models import ModelSpec
    from llmq.models.engine_spec import EngineSpec
    from llmq.models.sharding import make_plan

    EngineSpec(target="gguf", tp=1, pp=1, max_batch_size=1, max_seq_len=64, kv_cache_dtype="auto", block_size=16,
               dtype="float32", source={}, source_ids=[], plan=make_plan(ModelSpec.from_config(tiny), 1)
               ).write(tmp_path)
    with pytest.raises(LlmqError, match="is a 'gguf' engine; the bundled runtime loads `llmq build --target llmq`"):
        LLMEngine(tmp_path, EngineConfig())


def test_in_memory_tensor_parallelism_pads_heads_like_build(tmp_path, make_tiny_model):
    """6 query / 3 KV heads at tp 2: the runtime slices with the build stage's plan (padded to 8 / 4, exact)."""
    d = make_tiny_model(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    ids = rand_prompts([20], seed=3)[0]
    one = LLMEngine(d, EngineConfig(max_model_len=64)).prompt_logprobs(ids)
    eng = LLMEngine(d, EngineConfig(tp=2, max_model_len=64))
    try:
        assert torch.allclose(eng.prompt_logprobs(ids), one, atol=1e-4, rtol=0)
    finally:
        eng.shutdown()


def test_a_rank_given_rank_0s_spec_and_rotary_tables_loads_without_transformers(tiny, tmp_path):
    """The ranks past 0 get rank 0's ModelSpec and rope_tables (Worker's load_args): loading with them must not
    import transformers, whose config and modelling modules were most of every spawned rank's start. A fresh
    interpreter loads the tiny model that way and reports what it imported; derived there, both would import it."""
    import pickle
    import subprocess
    import sys

    from llmq.models.reader import CheckpointReader
    from llmq.runtime.layers.rotary import rope_tables

    ckpt = CheckpointReader(tiny)
    handoff = tmp_path / "handoff.pkl"
    handoff.write_bytes(pickle.dumps({"spec": ckpt.spec, "rope": rope_tables(ckpt.config, ckpt.spec)}))
    code = f"""import pickle, sys, torch
from llmq.models.reader import CheckpointReader
from llmq.runtime.model_runner import load_model
h = pickle.loads(open({str(handoff)!r}, "rb").read())
model, *_ = load_model(CheckpointReader({str(tiny)!r}, h["spec"]), 1, 0, None, torch.float32, torch.device("cpu"),
                       64, rope=h["rope"])
assert model.layers
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_tensor_parallel_two_ranks_equals_one(tiny, reference):
    prompts, ref = reference
    eng = LLMEngine(tiny, EngineConfig(tp=2, max_num_batched_tokens=32))
    try:
        got = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        lp = eng.prompt_logprobs(prompts[4])
        scored = eng.score([ScoreRequest(prompts[4], 1)])[0].logprobs
        with pytest.raises(LlmqError, match="observe_kv needs tp=1"), eng.observe_kv(print):
            pass
    finally:
        eng.shutdown()
    assert got == ref
    one = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=32)).prompt_logprobs(prompts[4])
    assert torch.allclose(lp, one, atol=1e-4)
    want = one[:-1].gather(1, torch.tensor(prompts[4][1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scored), want, atol=1e-4)


@pytest.mark.integration
def test_default_model_greedy_matches_transformers(default_model):
    eng = LLMEngine(default_model.path, EngineConfig(max_num_batched_tokens=64))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [eng.tokenizer.encode(t) for t in texts]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.output_token_ids for o in eng.generate(prompts, sp)]
    assert got == hf_greedy(default_model.path, prompts, 16)


def test_engine_artifact_tp2_with_padded_heads_equals_its_source(tmp_path, make_tiny_model, store):
    from llmq.models import resolve_model
    from llmq.pipeline.targets import BuildOptions, build_engine

    src = resolve_model(str(make_tiny_model(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3,
                                            hidden_size=96)), store)
    built = build_engine(src, store, BuildOptions(tp=2, pad_heads=True, parallel_embedding=True, max_batch_size=3,
                                                  block_size=8, max_seq_len=256))
    prompts = rand_prompts([5, 30, 70, 12], seed=4)
    ref = [o.output_token_ids for o in LLMEngine(src.path).generate(prompts, GREEDY)]
    eng = LLMEngine(built.path)
    try:
        assert (eng.tp, eng.block_size, eng.max_num_seqs, eng.max_model_len) == (2, 8, 3, 256)
        assert [o.output_token_ids for o in eng.generate(prompts, GREEDY)] == ref
    finally:
        eng.shutdown()


def test_long_prompt_is_chunked_without_stalling_decodes(tiny):
    eng = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=16, block_size=8))
    eng.add_request("short", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.step()  # prefill of the short prompt and its first token
    eng.add_request("long", rand_prompts([200], seed=3)[0], SamplingParams(max_tokens=2, temperature=0))
    steps_until_long_starts = 0
    for _ in range(13):  # 200 tokens at <= 15 per step (one goes to the decode) need 14 steps
        outs = {o.request_id: o for o in eng.step()}
        assert len(outs["short"].new_token_ids) == 1  # the decode got its token in every step
        steps_until_long_starts += "long" not in outs
    assert steps_until_long_starts == 13
    assert eng.requests["long"].num_computed_tokens == 13 * 15


def test_fp8_kv_cache_close_to_unquantized_and_self_consistent(tiny):
    ids = rand_prompts([80], seed=11)[0]
    ref = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=32)).prompt_logprobs(ids)
    eng = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=32, kv_cache_dtype="fp8"))  # uncalibrated: scale 1
    assert eng.runner.caches[0].k.element_size() == 1
    got = eng.prompt_logprobs(ids)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < 5e-3
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.9
    assert float((got - ref).abs().max()) > 1e-4  # the cache really is quantized
    # decoding from the quantized cache agrees with prefill over the same quantized cache
    out = eng.generate([ids[:40]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].output_token_ids
    lp = eng.prompt_logprobs(ids[:40] + out[:-1])
    assert lp[39:].argmax(-1).tolist() == out
