"""Hybrid models: Qwen3.5's Gated DeltaNet layers (a recurrent state per sequence) among full-attention layers, in
llmq's runtime against transformers 5.23 in float32: chunked prefill resuming a state, batched decodes on their state
slots, preemption, the delta rule against a float64 recurrence, quantized artifacts against transformers' loader, and
the one-line refusals of what the other stages do not take yet. Tensor parallelism (value heads split with their key
heads): tests/test_families.py at tp 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    Oracle,
    assert_refused_in_one_line,
    bf16_kernels_off,
    bf16_store,
    decompressed_dense,
    hf_model,
    kv_rounded_logits,
    make_tiny_model,
    runtime_logprobs,
)

from llmq.errors import LlmqError
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams
from llmq.runtime.speculative import DraftModelProposer
from llmq.runtime.worker import Worker

# 4 layers, three of them Gated DeltaNet (Qwen3.5's pattern); 2 key heads of 16 serving 4 value heads of 12
QWEN35 = dict(model_type="qwen3_5_text", num_hidden_layers=4, hidden_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=12)
# the same with a mixture of 8 experts of width 32 (2 a token) and a shared expert of width 48 for every MLP
QWEN35_MOE = QWEN35 | dict(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


# Qwen3-Next: the MoE's layers with the DeltaNet projections stored fused by key head (in_proj_qkvz, in_proj_ba)
QWEN3_NEXT = QWEN35_MOE | dict(model_type="qwen3_next")


@pytest.fixture(scope="module", params=[QWEN35, QWEN35_MOE, QWEN3_NEXT], ids=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def model(tmp_path_factory, request):
    """The tiny Qwen3.5 (dense or MoE) with every norm weight and dt_bias drawn at random (transformers initialises
    the (1 + w) norms to zero and dt_bias to one), so that each of them must be computed."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path_factory.mktemp("hybrid") / "qwen35", seed=4, **request.param)
    f = next(path.glob("*.safetensors"))
    g = torch.Generator().manual_seed(0)
    st = {k: (torch.rand(v.shape, generator=g) - 0.5 if k.endswith(("norm.weight", "dt_bias")) else v)
          for k, v in load_file(f).items()}
    save_file(st, f, metadata={"format": "pt"})
    return path


def _greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    hf = hf_model(path)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _kld(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def _reference_delta_rule(state, q, k, v, g, beta):
    """The gated delta rule token by token in float64: [T, H, D] inputs, state [H, Dk, Dv]."""
    s, out = state.double().clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        u = (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double())) * beta[t].double()[:, None]
        s = s + k[t].double()[:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(out), s


@pytest.mark.parametrize("block", [64, 5])
def test_chunked_delta_rule_and_its_steps_equal_the_recurrence_in_float64(block):
    from llmq.runtime.layers import delta_rule

    gen = torch.Generator().manual_seed(block)
    t, h, dk, dv = 150, 3, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(t, h, dv, generator=gen)
    g, beta = -2 * torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    start = torch.randn(h, dk, dv, generator=gen)
    want, want_state = _reference_delta_rule(start, q, k, v, g, beta)
    state = start.clone()
    got = delta_rule.chunked(state, q, k, v, g, beta, block=block)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert float((state - want_state).abs().max() / want_state.abs().max()) < 1e-5
    batched = torch.stack([start, start])   # two sequences at once, one step each
    steps = [delta_rule.step(batched, q[i].expand(2, h, dk), k[i].expand(2, h, dk), v[i].expand(2, h, dv),
                             g[i].expand(2, h), beta[i].expand(2, h)) for i in range(t)]
    assert float((torch.stack(steps, 1)[1] - want).abs().max() / want.abs().max()) < 1e-5
    # without the decay the outputs are far off: the tolerance above tells a wrong rule apart
    undecayed, _ = _reference_delta_rule(start, q, k, v, torch.zeros_like(g), beta)
    assert float((undecayed - want).abs().max() / want.abs().max()) > 1e-2


def test_runtime_equals_transformers_with_chunked_prefill_and_batched_decodes(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 17)]
    with torch.no_grad():
        ref = hf_model(model)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    # 16-token steps: the prompt's later chunks resume the recurrent state its earlier ones left
    eng = LLMEngine(model, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20, max_num_batched_tokens=16))
    try:
        got = eng.prompt_logprobs(ids).double()
        out = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        assert not eng.block_manager.enable_prefix_caching   # a recurrent state after a prefix is no KV block
        assert len(eng.block_manager.free_slots) == eng.max_num_seqs + 1   # every state slot handed back
    finally:
        eng.shutdown()
    assert _kld(ref, got) <= 1e-6
    assert out == _greedy(model, prompts)


def test_preempted_sequences_recompute_their_state(model):
    """A KV cache of 10 blocks of 4 tokens for 4 sequences that grow to 30 tokens: the youngest are preempted and
    recomputed from position 0 (their state slot handed back and taken again), with transformers' continuations."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (18,), generator=gen).tolist() for _ in range(4)]
    per_block = 4 * 2 * 1 * 2 * 24 * 4   # block size x K/V x attention layers x KV heads x head_dim x float32
    eng = LLMEngine(model, EngineConfig(max_model_len=32, block_size=4, kv_cache_memory=10 * per_block))
    try:
        out = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        assert eng.num_blocks == 10
        assert eng.scheduler.num_preemptions > 0
    finally:
        eng.shutdown()
    assert out == _greedy(model, prompts)


def test_speculation_rolls_recurrent_states_back_past_rejected_drafts(model, monkeypatch):
    """Drafts of the true greedy continuation, one token wrong half of the time (rejections at every position), in
    4-token blocks with a KV budget that preempts: the states go back to the accepted tokens (replayed from each
    slot's journal), and the output is plain greedy decoding's; states left past the rejected drafts change it."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19, 11, 26, 8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = dict(max_model_len=64, block_size=4, max_num_batched_tokens=32)
    per_block = 4 * 2 * 1 * 2 * 24 * 4   # block size x K/V x attention layers x KV heads x head_dim x float32
    ref = _run(LLMEngine(model, EngineConfig(**plain, kv_cache_memory=8 << 20)), prompts, params)

    def speculating() -> LLMEngine:
        eng = LLMEngine(model, EngineConfig(**plain, kv_cache_memory=30 * per_block, speculative="ngram",
                                            speculative_max_batch=None, num_speculative_tokens=5))
        eng.speculator.proposer = Oracle({tuple(p): r for p, r in zip(prompts, ref)}, seed=1)
        return eng

    eng = speculating()
    assert _run(eng, prompts, params) == ref
    st = eng.speculator.stats
    assert eng.scheduler.num_preemptions > 0
    assert 0.3 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[4] > 0   # whole drafts held too
    monkeypatch.setattr(Worker, "settle", lambda self, slot, kept: None)
    assert _run(speculating(), prompts, params) != ref


@pytest.mark.parametrize("model", [QWEN35], indirect=True, ids=["qwen3_5"])   # the same journals in every family
def test_a_hybrid_draft_model_rolls_its_own_states_back(model, tmp_path, monkeypatch):
    """A hybrid draft model: the target itself (every draft accepted), and the target with noise in its weights
    (rejections at every position, so the draft's states go back past its own drafts): the output is plain
    greedy's, and every draft is the draft model's own greedy continuation (transformers') of its sequence."""
    from safetensors.torch import load_file, save_file

    prompts = [list(range(40, 60)) * 2, [3, 9, 27, 81, 243], list(range(7, 30))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = dict(max_model_len=96, block_size=4, max_num_batched_tokens=32, kv_cache_memory=8 << 20)
    ref = _run(LLMEngine(model, EngineConfig(**plain)), prompts, params)
    noisy = shutil.copytree(model, tmp_path / "noisy")
    f = next(noisy.glob("*.safetensors"))
    g = torch.Generator().manual_seed(5)
    save_file({k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
               for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    proposals = []
    propose = DraftModelProposer.propose

    def recorded(self, seqs, ks):
        drafts, q = propose(self, seqs, ks)
        proposals.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts))
        return drafts, q

    monkeypatch.setattr(DraftModelProposer, "propose", recorded)
    for draft, all_accepted in ((model, True), (noisy, False)):
        proposals.clear()
        eng = LLMEngine(model, EngineConfig(**plain, speculative=str(draft), speculative_max_batch=None,
                                            num_speculative_tokens=3))
        st = eng.speculator.stats
        assert _run(eng, prompts, params) == ref
        assert st.num_draft_tokens > 20
        assert st.num_accepted_tokens > 0
        assert (st.num_accepted_tokens == st.num_draft_tokens) == all_accepted
    hf = hf_model(noisy)
    with torch.no_grad():
        for ids, d in proposals:
            assert hf.generate(torch.tensor([ids]), max_new_tokens=len(d), do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist() == d


def _run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    try:
        return [o.output_token_ids for o in eng.generate(prompts, params)]
    finally:
        eng.shutdown()


def test_what_the_runtime_does_not_run_with_gated_deltanet_layers_is_refused(model):
    with pytest.raises(LlmqError, match="^Qwen3(_5|_5Moe|Next)ForCausalLM: .*--compile") as e:
        LLMEngine(model, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20, compile=True))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def artifacts(model, tmp_path_factory):
    return bf16_store(model, tmp_path_factory.mktemp("hybrid-store"))


@pytest.mark.parametrize("method", [dict(method="rtn", bits=4, group_size=16), dict(method="gptq", bits=4,
                                                                                    group_size=16),
                                    dict(method="awq", bits=4, group_size=16),
                                    dict(method="autoround", bits=4, group_size=16, iters=5)],
                         ids=["rtn-w4g16", "gptq-w4g16", "awq-w4g16", "autoround-w4g16"])
def test_quantized_hybrid_computes_what_transformers_loads(artifacts, method, monkeypatch, tmp_path):
    """Every linear but the DeltaNet's rate projections (and a MoE's router and shared expert gate) in INT4
    (compressed-tensors, as vLLM loads it): llmq's runtime on its exact dequantize path gives transformers'
    distributions on the same artifact (a MoE's decompressed by compressed-tensors first: transformers fuses experts
    into 3-D tensors it cannot load packed)."""
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = artifacts
    art = quantize(src, QuantizeOptions(num_samples=4, seq_len=64, probe_tokens=128, **method), store,
                   progress=False)
    ignore = json.loads((art.path / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(CheckpointReader(art.path).spec.kept_16bit()) <= set(ignore)   # b / a (fused: ba), routers, gates
    assert {f"model.layers.{i}.linear_attn.in_proj_{r}" for i in (0, 1, 2) for r in "ab"} <= set(ignore) or \
        {f"model.layers.{i}.linear_attn.in_proj_ba" for i in (0, 1, 2)} <= set(ignore)
    ckpt = CheckpointReader(art.path)
    assert ckpt.layer_linears(0)["in_proj_qkv"].qw is not None
    assert ckpt.layer_linears(0)["in_proj_b"].qw is None
    moe = ckpt.spec.num_experts > 0
    if moe:
        lin = ckpt.layer_linears(3)
        assert all(lin[r].qw is not None for r in ("experts.7.down_proj", "shared_expert.gate_proj", "q_proj"))
        assert lin["router"].qw is None
        assert lin["shared_expert_gate"].qw is None
        assert {f"model.layers.{i}.mlp.{m}" for i in range(4) for m in ("gate", "shared_expert_gate")} <= set(ignore)
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        loaded = decompressed_dense(art, tmp_path / "dense") if moe else art.path
        ref = hf_model(loaded)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        source = hf_model(src.path)(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    bf16_kernels_off(monkeypatch)
    eng = LLMEngine(art.path, EngineConfig(max_model_len=64, kv_cache_memory=8 << 20))
    try:
        got = eng.prompt_logprobs(ids).double()
    finally:
        eng.shutdown()
    assert _kld(ref, got) <= 1e-5 < _kld(source, got)   # the quantized model, not its source


@pytest.mark.parametrize("model", [QWEN35_MOE], indirect=True, ids=["qwen3_5_moe"])   # its router and gates too
def test_smoothquant_hybrid_runs_as_its_probe_measured(model, artifacts):
    """SmoothQuant (W8A8, per-token activations) smooths a Gated DeltaNet layer's input like an attention layer's
    (in_proj_b / in_proj_a take the factors unquantized): what llmq's runtime computes from the artifact is what the
    quantize probe measured on its own fake-quantized layers (transformers does not round activations as the
    runtime does, so it is not the reference here)."""
    from helpers import runtime_probe_kld

    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = artifacts
    art = quantize(src, QuantizeOptions(method="smoothquant", bits=8, num_samples=4, seq_len=64, probe_tokens=128),
                   store, progress=False)
    recorded = art.metrics["probe"]["kld_mean"]
    assert recorded > 1e-5   # the quantization is visible
    assert abs(runtime_probe_kld(src.path, art.path, 128) / recorded - 1) < 1e-2


@pytest.mark.parametrize("model", [QWEN35, QWEN3_NEXT], indirect=True, ids=["qwen3_5", "qwen3_next"])  # its groups
def test_mixed_precision_prices_each_layer_by_its_kind(model, artifacts):
    """--target-bpw over a hybrid: a Gated DeltaNet layer's units (q / k / v with the gate z, out_proj) and an
    attention layer's are measured and priced each in its own layer, the rate projections (and a MoE's router and
    gates) stay 16-bit outside the budget, the choice fits it, and llmq's runtime computes what the probe measured."""
    from helpers import runtime_probe_kld

    from llmq.models.spec import ModelSpec
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.quantize.mixed import decoder_params

    store, src = artifacts
    spec = ModelSpec.from_config(src.path)
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=16, target_bpw=6.0, num_samples=2,
                                        seq_len=64, probe_tokens=128), store, progress=False)
    mp = art.config["mixed_precision"]
    units = {(u["layer"], tuple(u["modules"])) for u in mp["units"]}
    mixer = {i: {m for (j, mods) in units if j == i for m in mods if "attn" in m} for i in range(spec.num_layers)}
    fused = "in_proj_qkvz" if spec.model_type == "qwen3_next" else "in_proj_qkv"
    for i in range(spec.num_layers):
        if i in spec.linear_layers:
            assert {f"linear_attn.{fused}", "linear_attn.out_proj"} <= mixer[i]
            assert not any("in_proj_b" in m or "in_proj_a" in m or "self_attn" in m for m in mixer[i])
        else:
            assert mixer[i] == {f"self_attn.{r}" for r in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert mp["params"] == decoder_params(spec)
    assert mp["bpw"] <= 6.0
    assert len({u["bits"] for u in mp["units"]}) > 1   # the budget bought some units more than 4 bits
    recorded = art.metrics["probe"]["kld_mean"]
    assert recorded > 1e-6
    # the runtime's delta rule runs token by token, the probe's (transformers') in chunks: equal up to float32 order,
    # which in a mixture of experts can flip a near-tied expert choice at a token; a unit in the wrong format would
    # move the KLD by about its own kld_alone, far more
    tol = 3e-2 if spec.num_experts else 1e-2
    assert abs(runtime_probe_kld(src.path, art.path, 128) / recorded - 1) < tol


def test_awq_folds_its_scales_into_every_consumer_of_a_norm_exactly(artifacts, monkeypatch):
    """AWQ divides a norm by s and multiplies its consumers' columns by s, the 16-bit ones too (a Gated DeltaNet's
    in_proj_b / in_proj_a; a MoE's router and shared expert gate): the mixer and the MLP compute, in float, what they
    did before each fold. (A consumer left unscaled moves them by about the spread of s.)"""
    import llmq.pipeline.quantize.awq as awq
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = artifacts
    fold, moved = awq.fold_scales, {}
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))

    def checked(layer, producer, consumers, s, *args):
        block = {"input_layernorm": getattr(layer, "linear_attn", None), "post_attention_layernorm": layer.mlp}
        block = block.get(producer)
        norm = layer.get_submodule(producer)
        run = (lambda: block(norm(x.to(norm.weight.dtype))[None])) if block is not None else None
        before = run() if run else None
        fold(layer, producer, consumers, s, *args)
        if run:
            moved.setdefault(producer, []).append((float((run() - before).norm() / before.norm()),
                                                   float((s - 1).abs().max())))

    monkeypatch.setattr(awq, "fold_scales", torch.no_grad()(checked))
    quantize(src, QuantizeOptions(method="awq", bits=4, group_size=16, num_samples=4, seq_len=64, probe_tokens=0,
                                  name="awq-fold"), store, progress=False)
    assert set(moved) == {"input_layernorm", "post_attention_layernorm"}
    assert len(moved["input_layernorm"]) == 3   # the three Gated DeltaNet layers
    for producer, folds in moved.items():
        for err, spread in folds:
            assert spread > 0.02, producer   # scales that would show a consumer left out
            assert err < 1e-3 * spread, (producer, err, spread)


@pytest.mark.parametrize("kv,granularity", [("int8", "head")])   # FP8 / per tensor: tests/test_moe.py's
def test_kv_cache_scales_of_the_attention_layers_match_a_fake_quantized_transformers_cache(artifacts, kv,
                                                                                          granularity):
    """quantize-kv on a hybrid calibrates the attention layers' caches only (the Gated DeltaNet layers' recurrent
    state stays float32, and the manifest says so): the runtime on the artifact equals transformers with K / V
    rounded by the stored scales as they enter attention."""

    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.quantize.probe import kld_top1

    store, src = artifacts
    art = quantize_kv(src, store, KVOptions(kv=kv, granularity=granularity, num_samples=4, seq_len=64,
                                            probe_tokens=128), show_progress=False)
    ck = CheckpointReader(art.path)
    assert ck.kv_cache_dtype() == kv
    assert [i for i in range(4) if ck.kv_scales(i) is not None] == [3]   # the one attention layer
    assert art.config["recurrent_state"]["layers"] == [0, 1, 2]
    scales = {3: ck.kv_scales(3)}
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(4))
    plain, ref = kv_rounded_logits(src.path, ids, kv, scales)
    got = runtime_logprobs(art.path, ids[0].tolist())
    assert kld_top1(plain, got)["kld_mean"] > 1e-6   # the cache's rounding is visible
    assert kld_top1(ref, got)["kld_mean"] < 1e-7


@pytest.mark.parametrize("model", [QWEN35_MOE, QWEN3_NEXT], indirect=True, ids=["qwen3_5_moe", "qwen3_next"])
def test_llmq_engine_ranks_compute_what_the_artifact_does(model, artifacts):
    """`build --target llmq --tp 2` of a hybrid (its Gated DeltaNet layers cut by value heads, each rank with the key
    heads they read, convolution channels and decay parameters following): the build's own split check passes, and
    the engine served from its rank directories gives the unsharded artifact's distributions and continuations,
    with an INT8 KV cache whose scales are the attention layers' only. The MoE's DeltaNet layers are the dense
    model's, so Qwen3.5 dense is left to test_families' tensor-parallel check (CI's half hour)."""
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src = artifacts
    # groups of 8: a rank's out_proj input (2 value heads of 12) splits on group edges
    tp = 2
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=8, probe_tokens=0), store, progress=False)
    art = quantize_kv(art, store, KVOptions(kv="int8", num_samples=4, seq_len=64, probe_tokens=64),
                      show_progress=False)
    eng = build_engine(art, store, BuildOptions(target="llmq", tp=tp, verify=True))
    assert eng.metrics["verify"]["passed"]
    rank = CheckpointReader(eng.path / "rank0")
    assert rank.tensors.info("model.layers.0.linear_attn.A_log")[1] == [2]   # its 2 of the 4 value heads' decays
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    prompts = [ids[:7], ids[:19]]
    out = {}
    for path in (art.path, eng.path):
        e = LLMEngine(path, EngineConfig(tp=tp, max_model_len=128, kv_cache_memory=32 << 20))
        try:
            out[path] = (e.prompt_logprobs(ids).double(), [o.output_token_ids for o in e.generate(prompts, GREEDY)])
        finally:
            e.shutdown()
    (ref, want), (got, seqs) = out[art.path], out[eng.path]
    assert _kld(ref, got) <= 1e-6
    assert seqs == want


def test_stages_that_do_not_take_hybrid_models_yet_refuse_in_one_line(artifacts):
    from llmq.models.spec import ModelSpec
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src = artifacts
    calls = [(lambda: build_engine(src, store, BuildOptions(target="gguf")),
              "qwen3next layout" if ModelSpec.from_config(src.path).model_type == "qwen3_next" else
              "one head width for keys and values"),
             (lambda: build_engine(src, store, BuildOptions(target="trtllm", tp=2)), "Gated DeltaNet layers")]
    assert_refused_in_one_line(store, calls)


@pytest.mark.parametrize("change,words", [
    (lambda cfg, st: cfg.update(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                             "full_attention"]), "layer_types"),
    (lambda cfg, st: st.pop("model.layers.1.linear_attn.conv1d.weight"), "model.layers.1.linear_attn.conv1d.weight"),
    (lambda cfg, st: st.update({"model.layers.0.linear_attn.A_log": torch.zeros(3)}), "linear_attn.A_log"),
    (lambda cfg, st: cfg.update(linear_num_value_heads=3), "linear_num_value_heads=3"),
], ids=["unknown-layer-type", "missing-conv", "bad-decay-shape", "value-heads-not-grouped"])
def test_a_bad_hybrid_checkpoint_is_refused_naming_the_field_or_tensor(model, tmp_path, change, words):
    from safetensors.torch import load_file, save_file

    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = shutil.copytree(model, tmp_path / "bad")
    f = next(d.glob("*.safetensors"))
    cfg, st = json.loads((d / "config.json").read_text()), load_file(f)
    change(cfg, st)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(st, f, metadata={"format": "pt"})
    store = Store(tmp_path / "store")
    with pytest.raises(LlmqError, match=words) as e:
        resolve_model(str(d), store)
    assert "\n" not in str(e.value)
    assert not list(store.root.rglob("llmq.json"))
