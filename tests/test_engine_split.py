"""The engine split (issue 33, item 2) changed no number: greedy outputs, sampled outputs, log-probs, prompt_logprobs
and score results on a tiny model, with and without speculation (n-gram and a draft model), are bit-identical to
what the engine computed before the split.

Tokens are checked against independent paths where one exists (transformers' greedy decoding; plain decoding for
speculation). Log-probs have no independent bit-exact path, so they are compared with tests/data/engine_reference.pt,
recorded once by this module with the engine as it was before the split (LLMQ_RECORD_ENGINE_REFERENCE=1). Float
arithmetic depends on the CPU's kernels (the engines here run on the CPU even where a GPU is present): on a CPU of
another capability, vendor or family than the recording's (a Zen 5 EPYC, AMD family 26), floats are compared to 1e-5
and tokens still exactly.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy

from llmq.runtime import EngineConfig, LLMEngine, SamplingParams, ScoreRequest

REFERENCE = Path(__file__).parent / "data" / "engine_reference.pt"
RECORD = os.environ.get("LLMQ_RECORD_ENGINE_REFERENCE") == "1"
# 20 blocks of 4 tokens: chunked prefills beside decodes, and preemptions while five requests generate
CFG = dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=4, max_model_len=64, kv_cache_memory=20 * 2048,
           device="cpu")  # the references are CPU arithmetic


@pytest.fixture(scope="module")
def models(tiny_model):
    # the draft: the target's own weights, so drafts are accepted (greedy) or accepted at random (sampled)
    return tiny_model(seed=11, name="target"), tiny_model(seed=11, name="draft")


def cpu_arithmetic() -> str:
    """What fixes this CPU's float bits: PyTorch's kernel capability and the vendor and family whose code paths its
    libraries dispatch to (oneDNN / MKL pick by vendor; "AVX512" alone read the same on a Zen 5 EPYC and a Xeon whose
    bits differ). References recorded on another are compared to a tolerance."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    vendor, family = fields.get("vendor_id", "?"), fields.get("cpu family", "?")
    return f"{torch.backends.cpu.get_cpu_capability()} {vendor} family {family}"


def prompts():
    rng = random.Random(5)
    out = [[rng.randrange(256) for _ in range(n)] for n in (3, 17, 41, 9)]
    out.append(list(range(40, 52)) * 3)  # repetitive: the n-gram proposer has something to copy
    return out


def lp_tensor(logprobs):
    """[entries, 3] of (position, token id, log-prob) of a request's per-token logprob dicts."""
    return torch.tensor([[i, t, v] for i, d in enumerate(logprobs) for t, v in d.items()], dtype=torch.float64)


def observe(target: Path, draft: Path) -> dict:
    """What the engine computes on the tiny models, as tensors."""
    ps = prompts()
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    sampled = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True, logprobs=2)
               for i in range(len(ps))]
    out = {}
    for name, extra in (("plain", {}), ("ngram", dict(speculative="ngram")),
                        ("draft", dict(speculative=str(draft), num_speculative_tokens=3))):
        eng = LLMEngine(target, EngineConfig(**CFG, speculative_max_batch=None, **extra))
        try:
            for kind, params in (("greedy", greedy), ("sampled", sampled)):
                res = eng.generate(ps, params)
                out[f"{name}/{kind}/tokens"] = [torch.tensor(r.output_token_ids) for r in res]
                out[f"{name}/{kind}/logprobs"] = [lp_tensor(r.new_logprobs) for r in res]
            assert eng.scheduler.num_preemptions > 0, name
            if name != "plain":
                assert eng.speculator.stats.num_accepted_tokens > 0, name
            if name == "plain":
                out["prompt_logprobs"] = [eng.prompt_logprobs(p) for p in ps[1:3]]
                shared = ps[2][:30]
                reqs = [ScoreRequest(shared + [7, 8, 9], 30), ScoreRequest(shared + [1, 2], 29),
                        ScoreRequest(ps[1], 1), ScoreRequest(ps[3] + ps[0], len(ps[3]))]
                res = eng.score(reqs)
                out["score/logprobs"] = [torch.tensor(r.logprobs, dtype=torch.float64) for r in res]
                out["score/greedy"] = [torch.tensor(r.greedy) for r in res]
                out["score/cached"] = torch.tensor([r.num_cached_tokens for r in res])
        finally:
            eng.shutdown()
    return out


@pytest.fixture(scope="module")
def observed(models):
    got = observe(*models)
    if RECORD:
        REFERENCE.parent.mkdir(exist_ok=True)
        torch.save({"cpu": cpu_arithmetic(), "values": got}, REFERENCE)
    return got


def test_greedy_tokens_are_transformers_and_speculation_changes_none(models, observed):
    ps = prompts()
    ref = hf_greedy(models[0], ps, 20)
    for name in ("plain", "ngram", "draft"):
        assert [t.tolist() for t in observed[f"{name}/greedy/tokens"]] == ref, name


def test_everything_is_bit_identical_to_the_engine_before_the_split(observed):
    ref = torch.load(REFERENCE)
    same_cpu = ref["cpu"] == cpu_arithmetic()
    assert set(observed) == set(ref["values"])
    for key, want in ref["values"].items():
        got = observed[key]
        for g, w in zip(got, want) if isinstance(want, list) else [(got, want)]:
            if same_cpu or not w.is_floating_point():
                assert g.dtype == w.dtype, key
                assert torch.equal(g, w), key
            else:
                assert g.shape == w.shape, key
                assert torch.allclose(g, w, rtol=0, atol=1e-5), key



def test_decodes_first_is_the_one_stable_step_order():
    from llmq.runtime.scheduler import decodes_first

    assert decodes_first(list("abcdef"), [5, 1, 3, 1, 1, 2]) == (list("bdeacf"), [1, 1, 1, 5, 3, 2])
    assert decodes_first([], []) == ([], [])


DEFAULT_REFERENCE = Path(__file__).parent / "data" / "engine_reference_default.json"


def digest(t: torch.Tensor) -> str:
    import hashlib

    return f"{t.dtype} {tuple(t.shape)} " + hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.integration
def test_default_model_is_bit_identical_to_the_engine_before_the_split(default_model):
    """The same on SmolLM2-135M-Instruct (plain and n-gram decoding, prompt_logprobs, score), as sha256 digests of
    the tensors (tests/data/engine_reference_default.json, recorded before the split)."""
    import json

    eng = LLMEngine(default_model.path, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                                                     max_model_len=256, kv_cache_memory=64 << 20, device="cpu",
                                                     speculative="ngram", speculative_max_batch=None))
    try:
        tok = eng.tokenizer
        texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "one two three four one two three four one two"]
        ps = [tok.encode(t) for t in texts]
        res = eng.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
        got = {f"greedy/{i}/tokens": torch.tensor(r.output_token_ids) for i, r in enumerate(res)}
        got.update({f"greedy/{i}/logprobs": lp_tensor(r.new_logprobs) for i, r in enumerate(res)})
        got["prompt_logprobs"] = eng.prompt_logprobs(ps[1])
        reqs = [ScoreRequest(ps[0] + tok.encode(" Paris"), len(ps[0])),
                ScoreRequest(ps[0] + tok.encode(" Rome"), len(ps[0])), ScoreRequest(ps[1], 3)]
        scores = eng.score(reqs)
        got["score/logprobs"] = torch.tensor([x for r in scores for x in r.logprobs], dtype=torch.float64)
        got["score/greedy"] = torch.tensor([x for r in scores for x in r.greedy])
    finally:
        eng.shutdown()
    observed = {"cpu": cpu_arithmetic(),
                "tokens": {k: v.tolist() for k, v in got.items() if k.endswith("tokens")},
                "digests": {k: digest(v) for k, v in got.items()}}
    if RECORD:
        DEFAULT_REFERENCE.write_text(json.dumps(observed, indent=1) + "\n")
    ref = json.loads(DEFAULT_REFERENCE.read_text())
    assert observed["tokens"] == ref["tokens"]
    if ref["cpu"] == observed["cpu"]:  # float bits are only comparable on the CPU they were recorded on
        assert observed["digests"] == ref["digests"]
