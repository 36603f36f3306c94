"""Speculative decoding in the bundled runtime: proposals, verification inside continuous batching, KV rollback,
and losslessness (greedy output identical; sampled output distributed as without speculation)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import Oracle

from llmq.errors import LlmqError
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams, speculative
from llmq.runtime.speculative import Proposer, ngram_lookup


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(seed=3)


def prompts(n, seed=0):
    rng = random.Random(seed)
    out = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    out.append(list(range(30, 50)) * 3)  # repetitive: the n-gram proposer has something to copy
    return out


def run(eng, ps, params):
    return [o.output_token_ids for o in eng.generate(ps, params)]


def test_ngram_lookup_copies_after_the_latest_longest_match():
    t = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 2, 3])
    assert ngram_lookup(t, 3) == [7, 8, 0]  # suffix [2, 3]: latest earlier occurrence is followed by 7, 8, 0
    t = np.array([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3])
    assert ngram_lookup(t, 2) == [4, 8]  # [1, 2, 3] (n=3) beats the later [2, 3] (n=2)
    assert ngram_lookup(np.array([4, 5, 6, 7]), 3) == []
    assert ngram_lookup(np.array([1, 2, 1, 2]), 5) == [1, 2]  # runs into the suffix: as many as there are


@pytest.mark.parametrize("cfg", [dict(block_size=4, max_num_batched_tokens=24),
                                 dict(block_size=8, max_num_batched_tokens=64, enable_prefix_caching=False),
                                 dict(block_size=16, max_num_batched_tokens=512, num_speculative_tokens=7)])
def test_ngram_greedy_is_identical_to_plain_greedy(tiny, cfg):
    ps = prompts(8)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = {k: v for k, v in cfg.items() if k != "num_speculative_tokens"}
    ref = run(LLMEngine(tiny, EngineConfig(**plain)), ps, params)
    eng = LLMEngine(tiny, EngineConfig(speculative="ngram", speculative_max_batch=None, **cfg))
    assert run(eng, ps, params) == ref
    st = eng.speculator.stats
    assert st.num_draft_tokens > 50
    assert st.num_accepted_tokens > 10  # it did speculate, and some drafts held
    assert eng.block_manager.num_used_blocks == 0


def _check_prefix_cache(bm, sequences):
    """Every cached block key is a block of some real sequence's hash chain: no rejected token was ever hashed."""
    real = {key for ids in sequences for key in bm.block_keys(ids, len(ids) // bm.block_size)}
    assert bm.cached
    assert set(bm.cached) <= real
    assert all(bm.block_key[b] == k for k, b in bm.cached.items())


def test_rollback_keeps_cache_consistent_under_preemption(tiny):
    """Drafts accepted and rejected at every position, a KV budget small enough to preempt, prefix caching on: the
    output equals plain greedy, no rejected token enters a block hash, and every block comes back."""
    ps = prompts(10, seed=1)
    ps += [p[:len(p) // 2] + [7, 7] for p in ps[:4]]  # shared prefixes: cache hits on blocks speculation wrote
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = run(LLMEngine(tiny, EngineConfig(block_size=4, max_num_batched_tokens=32)), ps, params)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    probe = LLMEngine(tiny, EngineConfig(block_size=4))
    block_bytes = probe.runner.caches[0].k[0].numel() * 4 * 2 * probe.spec.num_layers
    eng = LLMEngine(tiny, EngineConfig(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, speculative="ngram",
                                       kv_cache_memory=40 * block_bytes, max_model_len=104,
                                       speculative_max_batch=None, num_speculative_tokens=6))
    eng.speculator.proposer = Oracle(truth)
    assert run(eng, ps, params) == ref
    st = eng.speculator.stats
    assert eng.scheduler.num_preemptions > 0
    assert st.num_accepted_tokens > st.num_draft_tokens * 0.4
    assert st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[5] > 0  # whole 6-token drafts were accepted
    assert eng.block_manager.num_used_blocks == 0
    _check_prefix_cache(eng.block_manager, [p + r for p, r in zip(ps, ref)])


def test_stops_logprobs_and_lengths_match_plain_decoding(tiny):
    ps = prompts(5, seed=2)
    ref_eng = LLMEngine(tiny, EngineConfig(block_size=8))
    eng = LLMEngine(tiny, EngineConfig(block_size=8, speculative="ngram", speculative_max_batch=None))
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    truth = {tuple(p): r for p, r in zip(ps, run(ref_eng, ps, greedy))}
    eng.speculator.proposer = Oracle(truth, seed=4)
    stop_tok = truth[tuple(ps[0])][12]
    for params in (SamplingParams(max_tokens=17, temperature=0, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok]),
                   SamplingParams(max_tokens=30, temperature=0, stop=[ref_eng.tokenizer.decode([stop_tok])])):
        want, got = ref_eng.generate(ps, params), eng.generate(ps, params)
        for w, g in zip(want, got):
            assert (g.output_token_ids, g.text, g.finish_reason) == (w.output_token_ids, w.text, w.finish_reason)
            if params.logprobs:
                assert len(g.new_logprobs) == len(w.new_logprobs) == 17
                for a, b in zip(w.new_logprobs, g.new_logprobs):
                    assert a.keys() == b.keys()
                    assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    assert eng.speculator.stats.num_accepted_tokens > 20


def test_backs_off_when_more_sequences_run_than_the_limit(tiny):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng = LLMEngine(tiny, EngineConfig(speculative="ngram", speculative_max_batch=3))
    eng.generate([list(range(30, 50)) * 3] * 4, params)  # four running: above the limit, never a draft
    assert eng.speculator.stats.num_drafts == 0
    eng.generate([list(range(30, 50)) * 3] * 2, params)
    assert eng.speculator.stats.num_drafts > 0


def test_bad_speculative_settings_are_refused(tiny):
    with pytest.raises(LlmqError, match="speculative"):
        LLMEngine(tiny, EngineConfig(speculative="bigram"))
    with pytest.raises(LlmqError, match="--num-speculative-tokens must be >= 1"):
        LLMEngine(tiny, EngineConfig(speculative="ngram", num_speculative_tokens=0))


# -- rejection sampling keeps the target's distribution -------------------------------------------------------------

class ModeDraft(Proposer):
    """Drafts from a table of the most frequent next token after each output prefix (learnt from plain samples):
    either that token (a point-mass q), or, with `spread`, a draw from q = that token with probability 1 - spread,
    else uniform over the vocabulary, reporting q (the draft-model path)."""

    name = "mode"

    def __init__(self, table: dict[tuple, int], vocab: int, spread: float | None = None, seed=0):
        self.table, self.vocab, self.spread = table, vocab, spread
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, seqs, ks):
        drafts, qs = [], []
        for s, k in zip(seqs, ks):
            out, draft, q = list(s.output_token_ids), [], []
            for _ in range(k):
                mode = self.table.get(tuple(out), 0)
                if self.spread is not None:
                    row = torch.full((self.vocab,), self.spread / self.vocab)
                    row[mode] += 1 - self.spread
                    mode = int(torch.multinomial(row, 1, generator=self.gen))
                    q.append(row)
                draft.append(mode)
                out.append(mode)
            drafts.append(draft)
            qs.append(torch.stack(q) if q else None)
        return drafts, (qs if self.spread is not None else None)


def _histogram(eng, n, params):
    prompt = [40, 41, 42, 43, 44]
    outs = eng.generate([prompt] * n, [SamplingParams(**params, seed=i) for i in range(n)])
    return [tuple(o.output_token_ids) for o in outs]


def _two_sample_p(a, b) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution."""
    a, b = [x[1] for x in a], [x[1] for x in b]  # token 2: the first draft token verified
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[x.count(c) for c in cats] for x in (a, b)], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(cats) - 1) / 2, dtype=torch.float64), stat / 2))


def _wrong_accept(probs, draft, q, generator):
    """A plausible but wrong rule: accept with min(1, p/q) and, on rejection, draw from p instead of the residual."""
    k = len(draft)
    d = torch.tensor(draft)
    ratio = probs[torch.arange(k), d] if q is None else (probs[torch.arange(k), d] / q[torch.arange(k), d]).clamp(max=1)
    u = torch.rand(k, generator=generator)
    rej = (u >= ratio).nonzero()
    a = int(rej[0]) if len(rej) else k
    return a, int(torch.multinomial(probs[a], 1, generator=generator))


@pytest.fixture(scope="module")
def histograms(tiny):
    params = dict(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)
    n = 1500
    plain = _histogram(LLMEngine(tiny, EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024)), n, params)
    # drafts worth testing: the most frequent next tokens, so acceptances and rejections both abound
    counts: dict[tuple, dict[int, int]] = {}
    for out in plain:
        for i in range(1, len(out)):
            c = counts.setdefault(out[:i], {})
            c[out[i]] = c.get(out[i], 0) + 1
    return plain, params, n, {pre: max(c, key=c.get) for pre, c in counts.items()}


@pytest.mark.parametrize("kind", ["point", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(tiny, histograms, monkeypatch, kind):
    plain, params, n, table = histograms
    cfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024, speculative="ngram", speculative_max_batch=None,
                       num_speculative_tokens=2)

    def spec_sample():
        eng = LLMEngine(tiny, cfg)
        eng.speculator.proposer = ModeDraft(table, eng.spec.vocab_size, None if kind == "point" else 0.3)
        got = _histogram(eng, n, params)
        st = eng.speculator.stats
        assert 0.08 < st.num_accepted_tokens / st.num_draft_tokens < 0.85, st  # both outcomes are exercised
        return got

    assert _two_sample_p(plain, spec_sample()) > 1e-3
    monkeypatch.setattr(speculative, "accept", _wrong_accept)
    assert _two_sample_p(plain, spec_sample()) < 1e-6  # the test tells a wrong acceptance rule apart


# -- interfaces: /metrics, eval, CLI -------------------------------------------------------------------------------

def test_server_reports_vllm_spec_decode_metrics(tiny):
    import httpx
    from helpers import live_server
    from prometheus_client.parser import text_string_to_metric_families

    prompt = list(range(30, 50)) * 3
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = run(LLMEngine(tiny, EngineConfig()), [prompt], params)[0]
    with live_server(tiny, EngineConfig(speculative="ngram", num_speculative_tokens=3)) as srv:
        r = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == want
        m = srv.metrics()
        text = httpx.get(f"{srv.url}/metrics").text
    drafts, drafted = m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0
    assert drafted >= drafts
    assert 0 < accepted <= drafted
    assert m["vllm:spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    per_pos = {s.labels["position"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos["0"] > 0
    assert sum(per_pos.values()) == accepted
    assert m["vllm:generation_tokens_total"] == 24


def test_eval_scores_are_the_same_with_speculation(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner
    from helpers import make_tiny_model

    from llmq.artifacts import Store
    from llmq.cli.main import cli
    from llmq.models import resolve_model

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store = Store(tmp_path / "store")
    art = resolve_model(str(make_tiny_model(tmp_path / "m", seed=0)), store)
    reports = []
    for extra in ([], ["--speculative", "ngram", "--speculative-max-batch", "64"]):
        res = CliRunner().invoke(cli, ["--store", str(store.root), "eval", art.ref, "--tasks", "code", "--limit", "4",
                                       "--baseline", "none", "--json", *extra])
        assert res.exit_code == 0, res.output
        reports.append(json.loads(res.output[res.output.index("{"):res.output.rindex("}") + 1]))
    assert reports[1]["settings"]["speculative"]["speculative"] == "ngram"
    assert "llmq_code_greedy" in reports[0]["scores"]["tasks"]  # a generation task: speculation had work
    assert reports[0]["scores"] == reports[1]["scores"]
    bad = CliRunner().invoke(cli, ["--store", str(store.root), "eval", art.ref, "--backend", "hf",
                                   "--speculative", "ngram"])
    assert bad.exit_code != 0
    assert "--backend llmq" in bad.output


# -- draft model -------------------------------------------------------------------------------------------------

def test_draft_model_of_the_target_itself_is_always_accepted_and_identical(tiny):
    """The target as its own draft: every greedy draft token is the target's argmax, so all are accepted (the
    draft's own KV cache, rollback and catch-up are right), and the output is plain greedy's."""
    ps = prompts(6, seed=5)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = run(LLMEngine(tiny, EngineConfig(block_size=4, max_num_batched_tokens=32)), ps, params)
    eng = LLMEngine(tiny, EngineConfig(block_size=4, max_num_batched_tokens=32, speculative=str(tiny),
                                       speculative_max_batch=None, num_speculative_tokens=3))
    assert run(eng, ps, params) == ref
    st = eng.speculator.stats
    assert st.num_draft_tokens > 60
    assert st.num_accepted_tokens == st.num_draft_tokens
    draft = eng.speculator.proposer
    assert not draft.mirrors
    assert draft.worker.block_manager.num_used_blocks == 0  # finished requests' KV freed
    eng.shutdown()


def test_a_different_draft_model_is_lossless(tmp_path, tiny):
    """A draft that disagrees often (another random model): rejections at every position roll the draft's own
    cache back; greedy output stays plain greedy's and sampled output keeps its seeds' determinism."""
    from helpers import make_tiny_model

    other = make_tiny_model(tmp_path / "draft", seed=11, num_hidden_layers=1)
    ps = prompts(6, seed=6)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = run(LLMEngine(tiny, EngineConfig(block_size=4)), ps, params)
    eng = LLMEngine(tiny, EngineConfig(block_size=4, speculative=str(other), speculative_max_batch=None))
    assert run(eng, ps, params) == ref
    st = eng.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, tiny):
    from helpers import make_tiny_model
    from transformers import AutoTokenizer

    other = make_tiny_model(tmp_path / "d", seed=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(LlmqError, match="different tokenizer"):
        LLMEngine(tiny, EngineConfig(speculative=str(other)))
