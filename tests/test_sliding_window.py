"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window) against transformers, past the window."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import hf_logits

import llmq.runtime.worker as worker_mod
from llmq.models.spec import attends
from llmq.pipeline.quantize.probe import kld_top1
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

WINDOW = 16


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_window_convention_is_transformers():
    from transformers.masking_utils import sliding_window_causal_mask_function

    seen = sliding_window_causal_mask_function(WINDOW)
    want = seen(0, 0, torch.arange(40)[:, None], torch.arange(40)[None, :])
    assert torch.equal(attends(torch.arange(40)[:, None], torch.arange(40)[None, :], WINDOW), want)
    assert want[20].sum() == WINDOW  # the query's own position and the WINDOW - 1 before it


@pytest.fixture(scope="module")
def mistral(tiny_model):
    return tiny_model(seed=5, model_type="mistral", sliding_window=WINDOW)


@pytest.mark.parametrize("budget", [128, 24, 5])  # one fresh prefill; chunks over a cached prefix; chunks < window
def test_prefill_past_the_window_matches_transformers(mistral, budget):
    ids = rand_ids(70, seed=7)
    eng = LLMEngine(mistral, EngineConfig(max_num_batched_tokens=budget, block_size=8))
    k = kld_top1(hf_logits(mistral, ids), eng.prompt_logprobs(ids))
    assert k["kld_mean"] <= 1e-5, k
    assert k["top1"] == 1.0, k


def test_qwen2_all_layers_sliding_matches_transformers(tmp_path, make_tiny_model):
    d = make_tiny_model(tmp_path / "q", seed=6, model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                        max_window_layers=0)
    ids = rand_ids(50, seed=8)
    eng = LLMEngine(d, EngineConfig(max_num_batched_tokens=20, block_size=8))
    k = kld_top1(hf_logits(d, ids), eng.prompt_logprobs(ids))
    assert k["kld_mean"] <= 1e-5, k
    assert k["top1"] == 1.0, k


def test_decode_and_mixed_batches_past_the_window_match_transformers(mistral, monkeypatch):
    """Every logits row the engine samples from (decodes alone, decodes beside prefill chunks) vs transformers."""
    rows: list[tuple[str, int, str]] = []  # (request, position of the last context token, kind of step)
    got: list[torch.Tensor] = []
    real_prepare = worker_mod.prepare_step

    def recording_prepare(seqs, num_new, *args, **kw):
        kind = "decode" if all(n == 1 for n in num_new) else "mixed" if 1 in num_new else "prefill"
        rows.extend((s.request_id, s.num_tokens - 1, kind) for s, n in zip(seqs, num_new)
                    if s.num_computed_tokens + n == s.num_tokens)
        return real_prepare(seqs, num_new, *args, **kw)

    monkeypatch.setattr(worker_mod, "prepare_step", recording_prepare)
    eng = LLMEngine(mistral, EngineConfig(max_num_batched_tokens=24, max_num_seqs=4, block_size=8))
    real_forward = eng.worker.forward
    eng.worker.forward = lambda step: got.append(real_forward(step)) or got[-1]
    prompts = {"a": rand_ids(5, 1), "b": rand_ids(40, 2), "c": rand_ids(3, 3), "d": rand_ids(70, 4)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    outputs = {}
    while eng.has_unfinished():
        outputs.update((o.request_id, o.output_token_ids) for o in eng.step())
    full = {rid: prompts[rid] + outputs[rid] for rid in prompts}
    ref = {rid: hf_logits(mistral, ids) for rid, ids in full.items()}
    ref_rows = torch.stack([ref[rid][pos] for rid, pos, _ in rows])
    got_rows = torch.cat(got).log_softmax(-1)
    assert {k for _, p, k in rows if p >= WINDOW} == {"decode", "mixed"}
    k = kld_top1(ref_rows, got_rows)
    assert k["kld_mean"] <= 1e-5, k
    assert k["top1"] == 1.0, k


def test_eval_scoring_applies_the_window(mistral):
    from llmq.runtime import ScoreRequest

    items = [ScoreRequest(rand_ids(60, 9), 20), ScoreRequest(rand_ids(45, 10), 5), ScoreRequest(rand_ids(3, 11), 1)]
    eng = LLMEngine(mistral, EngineConfig(max_num_batched_tokens=24, block_size=8))
    for item, score in zip(items, eng.score(items)):
        lsm = hf_logits(mistral, item.token_ids).log_softmax(-1)[item.start - 1:-1]
        want = lsm.gather(1, torch.tensor(item.token_ids[item.start:])[:, None])[:, 0]
        assert score.logprobs == pytest.approx(want.tolist(), abs=1e-5)
