"""The batched sampler's cost per step with grammar masks (llguidance), beside the unconstrained step, in one run.

A batch of 32 rows of the default model's vocabulary (SmolLM2, 49,152 tokens): random logits each step, sampled by
`llmq.runtime.sampling.sample` with no grammar, with every row under a JSON-schema grammar, and with half the rows
under one; each constrained row's matcher advances by its sampled token (and starts over when its answer is whole),
so the masks are those of real JSON answers in every state.

    python benchmarks/grammar_masks.py [--batch 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from llmq.artifacts import Store
from llmq.bench.hw import load_per_core, machine_key
from llmq.models import load_tokenizer, resolve_model
from llmq.models.tool_calls import JSON_STYLE
from llmq.runtime.grammar import Grammars, advance
from llmq.runtime.sampling import SamplingParams, sample

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}


def run(batch: int, steps: int, constrained: int, grammars: Grammars, eos: set[int], vocab: int) -> list[float]:
    params = [SamplingParams(max_tokens=1 << 20, temperature=1.0) for _ in range(batch)]
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    matchers = [grammars.json_schema(SCHEMA, JSON_STYLE).claim() if i < constrained else None for i in range(batch)]
    times = []
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gens[step % batch])
        t = time.perf_counter()
        tokens, _ = sample(logits, params, gens, matchers if constrained else None)
        for m, tok in zip(matchers, tokens):
            if m is not None:
                if tok in eos or m.is_stopped():
                    m.reset()
                else:
                    advance(m, tok)
        times.append(time.perf_counter() - t)
    return times[10:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as d:
        model = resolve_model(None, Store(d))
        tok = load_tokenizer(model.path)
    vocab = len(tok)
    eos = {tok.eos_token_id}
    grammars = Grammars(tok, vocab, eos)
    grammars.prepare()
    print(f"CPU: {machine_key('cpu')}, load per core {load_per_core()}")
    print(f"vocabulary {vocab}; batch {a.batch}; {a.steps} steps each (median, p90)")
    base = None
    for label, n in (("unconstrained", 0), (f"{a.batch // 2} of {a.batch} rows constrained", a.batch // 2),
                     (f"all {a.batch} rows constrained", a.batch)):
        t = run(a.batch, a.steps, n, grammars, eos, vocab)
        med, p90 = statistics.median(t) * 1e3, statistics.quantiles(t, n=10)[-1] * 1e3
        base = base or med
        print(f"  {label:32s} {med:7.2f} ms  p90 {p90:7.2f} ms  x{med / base:.2f}")


if __name__ == "__main__":
    main()
