"""The compiled decode step (EngineConfig.compile) against the eager forward it replaces: the same tokens and the
same log-probabilities, at batch 1 and for a batch of concurrent decodes, dense (float32 and bfloat16 weights) and
quantized (INT4 layers, INT8 lm_head, INT8 KV cache)."""

from __future__ import annotations

import pytest

from llmq.errors import LlmqError
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [[5, 9, 33, 100, 7], [40, 41, 42] * 7, list(range(60, 100))]  # 5 / 21 / 40 tokens: 1, 2 and 3 blocks


def _run(eng: LLMEngine, prompts: list[list[int]]) -> tuple[list, list]:
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{len(prompts)}-{i}", p, sp)
    tokens, logprobs = {}, []
    while eng.has_unfinished():
        for out in eng.step():
            logprobs += [next(iter(d.values())) for d in out.new_logprobs or []]
            if out.finished:
                tokens[out.request_id] = out.output_token_ids
    return [tokens[k] for k in sorted(tokens)], logprobs


def _decode(path, compile: bool, kv: str = "auto") -> tuple[list, list]:
    """Greedy tokens and their logprobs: the third prompt alone (batch 1), then all three together (batch 3)."""
    eng = LLMEngine(path, EngineConfig(max_num_seqs=4, kv_cache_memory=16 << 20, kv_cache_dtype=kv,
                                       compile=compile))
    try:
        alone, lp_alone = _run(eng, [PROMPTS[2]])
        together, lp_together = _run(eng, PROMPTS)
        return alone + together, lp_alone + lp_together
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model):
    import torch
    from helpers import make_tiny_model
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    root = tmp_path_factory.mktemp("compiled")
    store = Store(root / "store")
    dense = resolve_model(str(tiny_model(seed=3, tie_word_embeddings=True)), store)
    bf16_dir = make_tiny_model(root / "tiny-bf16", seed=3, tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    bf16 = resolve_model(str(bf16_dir), store)  # on CPU: 16-bit weights on llmq's dense16 kernel, eagerly
    int4 = quantize(dense, QuantizeOptions(method="rtn", bits=4, group_size=32, lm_head="int8", probe_tokens=0),
                    store, progress=False)
    int4_kv8 = quantize_kv(int4, store, KVOptions(kv="int8", num_samples=2, seq_len=64, probe_tokens=64),
                           show_progress=False)
    return {"dense": dense.path, "dense-bf16": bf16.path, "int4-head8-kv8": int4_kv8.path}


@pytest.mark.parametrize("name", ["dense", "dense-bf16", "int4-head8-kv8"])
def test_compiled_decode_equals_the_eager_forward(sources, name):
    kv = "int8" if name.endswith("kv8") else "auto"
    eager_tokens, eager_lp = _decode(sources[name], False, kv)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    tokens, lp = _decode(sources[name], True, kv)
    assert counters["stats"]["unique_graphs"] > graphs  # the decode steps did run compiled
    assert tokens == eager_tokens
    gaps = [abs(a - b) for a, b in zip(lp, eager_lp)]
    # float32 reassociation; a wrong graph is O(1). The INT4 / INT8 kernels round activations to bfloat16, where a
    # reassociated sum can land on the neighbouring value and move a log-prob by ~1e-3 (once in 96 on a Xeon: 3.1e-4)
    assert len(gaps) == 4 * 24, max(gaps)
    assert max(gaps) < (1e-4 if name.startswith("dense") else 2e-3), max(gaps)


def test_compile_is_refused_where_it_cannot_run(sources, monkeypatch):
    with pytest.raises(LlmqError, match="use it with tp 1"):
        LLMEngine(sources["dense"], EngineConfig(tp=2, compile=True))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    with pytest.raises(LlmqError, match="needs a C\\+\\+ compiler"):
        LLMEngine(sources["dense"], EngineConfig(compile=True, kv_cache_memory=8 << 20))
