"""Gemma 3 270M, the second real model (its Q4_K_M GGUF from PyPI, imported as `gemma3-270m`), through import,
the runtime against transformers, quantize (GPTQ), eval's KLD and serve. About two minutes on 2 cores (its
262k-token vocabulary makes every probe and export slow: AWQ and the GGUF export, ~40 s and ~75 s here, are left to
the tiny Gemma 3 of test_families, which covers tp 2 and every export contract, and to
benchmarks/gguf_in_llamacpp.py on this model; `llmq run` to the quickstart's test on the default model)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from helpers import live_server

from llmq.artifacts import Store

pytestmark = pytest.mark.integration
# act-order: its static groups take one scale search per linear, not one per group of 32 columns
CALIB = dict(bits=4, group_size=32, act_order=True, num_samples=2, seq_len=64, probe_tokens=256)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from llmq.models import resolve_model

    store = Store(tmp_path_factory.mktemp("gemma3") / "store")
    return store, resolve_model("gemma3-270m", store)


@pytest.fixture(scope="module")
def ids(gemma):
    from llmq.models.load import load_tokenizer

    tok = load_tokenizer(gemma[1].path)
    return tok("The capital of France is Paris. The capital of Germany is").input_ids


def test_imported_by_its_short_name_with_provenance_and_license(gemma):
    _, art = gemma
    src, arch = art.config["source"], art.config["architecture"]
    assert src["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert len(src["wheels"]) == 5
    assert "Gemma Terms of Use" in src["license"]
    assert (arch["model_type"], arch["num_layers"], arch["hidden_size"], arch["num_heads"], arch["num_kv_heads"],
            arch["head_dim"], arch["vocab_size"]) == ("gemma3_text", 18, 640, 4, 1, 256, 262144)
    assert len(arch["local_layers"]) == 15
    assert arch["local_window"] == 512  # five local layers to one global


def test_runtime_equals_transformers(gemma, ids):
    from transformers import AutoModelForCausalLM

    from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

    _, art = gemma
    hf = AutoModelForCausalLM.from_pretrained(art.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    eng = LLMEngine(art.path, EngineConfig(max_model_len=256))
    try:
        got = eng.prompt_logprobs(ids).double()
        out = eng.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0].output_token_ids
    finally:
        eng.shutdown()
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) <= 1e-6
    assert out == want


def test_quantize_gptq_then_eval_and_serve(gemma, ids):
    from llmq.evals.evaluate import EvalSettings, run_eval
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime import EngineConfig

    store, base = gemma
    gptq = quantize(base, QuantizeOptions(method="gptq", **CALIB), store, progress=False)
    probe = gptq.metrics["probe"]
    assert math.isfinite(probe["kld_mean"]), probe
    assert 0 < probe["kld_mean"] < 5, probe
    report = run_eval(store, gptq, base, EvalSettings(tasks=["kld"], limit=4, seed=0), []).report
    assert 0 < report["kld"]["mean"] < 5
    assert 0 < report["kld"]["top1"] < 100  # top-1 in percent

    with live_server(gptq.path, EngineConfig(max_model_len=256, kv_cache_memory=64 << 20), name="gemma") as live:
        r = httpx.post(f"{live.url}/v1/completions", timeout=120,
                       json={"model": "gemma", "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["text"]
