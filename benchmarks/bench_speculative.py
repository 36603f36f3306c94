"""Speculative decoding in the bundled runtime, against plain decoding, in one run on one engine.

One target engine (default: the embedded SmolLM2-135M-Instruct) is run with its speculator swapped between none,
n-gram prompt lookup and a draft model (the target's own INT4 RTN artifact, whose quantize probe measured its top-1
agreement with the target), interleaved prompt by prompt so machine noise hits every mode alike. Printed:

- batch 1: median TPOT per prompt category (input-grounded: edit a given function, answer by quoting a given
  passage; open-ended chat), the ratio plain / speculative, and the acceptance rate; whether greedy outputs are
  byte-identical to plain decoding;
- concurrency sweep (1..32 requests at once): output tokens/s of n-gram speculation with and without back-off
  against plain decoding, to show where speculation stops paying and that back-off keeps the loss small;
- the INT4 draft's acceptance next to its probe's top-1 agreement.

    python benchmarks/bench_speculative.py [--model REF] [--store DIR] [--reps 3] [--max-tokens 96] [--k 4]
        [--draft-k 3] [--no-draft] [--concurrency 1,4,8,16,32] [--json OUT]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.artifacts import Store  # noqa: E402
from llmq.models import resolve_model  # noqa: E402
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from llmq.runtime.speculative import make_speculator  # noqa: E402


def _functions() -> list[tuple[str, str, str]]:
    import shlex
    import textwrap

    return [(inspect.getsource(textwrap.dedent), "margin", "common_indent"),
            (inspect.getsource(shlex.quote), "s", "text"),
            (inspect.getsource(textwrap.indent), "prefix", "pad")]


PASSAGES = [
    ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps each sequence's positions to "
     "blocks, so sequences of any length share one pool of memory without fragmentation. When two requests share a "
     "prefix, their first blocks can be shared too, which saves both memory and the time to compute them again. "
     "Blocks are freed when a request finishes, and cached blocks stay findable until their memory is reused.",
     "What happens to blocks when a request finishes?"),
    ("Rust guarantees memory safety through ownership. Every value has a single owner, and the value is dropped when "
     "its owner goes out of scope. References borrow a value without taking ownership, and the borrow checker makes "
     "sure that no reference outlives the value it points to. Mutable references are exclusive: while one exists, no "
     "other reference to the same value may be used.",
     "What does the passage say about mutable references?"),
    ("The Great Barrier Reef is the largest coral reef system in the world. It lies off the coast of Queensland, "
     "Australia, and stretches for more than two thousand kilometres. The reef is made of billions of tiny organisms "
     "called coral polyps. It supports a wide diversity of life and was selected as a World Heritage Site in 1981.",
     "Where is the Great Barrier Reef?"),
]

CHAT = ["Write a short poem about autumn leaves.", "Give me three tips for learning to cook at home.",
        "Explain to a child why the sky is blue.", "What should I pack for a weekend hiking trip?"]


def prompts(tok) -> dict[str, list[list[int]]]:
    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)

    edit = [chat(f"Rename the variable `{a}` to `{b}` in this Python function. Reply with the whole edited function "
                 f"only.\n\n```python\n{src}```") for src, a, b in _functions()]
    quote = [chat(f"Passage:\n{p}\n\nQuestion: {q}\nAnswer by quoting the relevant sentences of the passage "
                  "exactly.") for p, q in PASSAGES]
    return {"edit": edit, "quote": quote, "chat": [chat(c) for c in CHAT]}


def delta(before, after) -> tuple[int, int]:
    return (after.num_draft_tokens - before.num_draft_tokens, after.num_accepted_tokens - before.num_accepted_tokens)


def copied(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of the output's n-grams that occur in the prompt: how much of the answer is the input, a property
    of the model's answer that bounds what prompt lookup can draft."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(output[i:i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else 0.0


def batch1(eng: LLMEngine, modes: dict, cats: dict, reps: int, max_tokens: int) -> dict:
    """TPOT (s), drafted / accepted tokens and output text per mode, category and prompt."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    res = {m: {c: {"tpot": [], "drafted": 0, "accepted": 0, "texts": {}, "by_prompt": {}} for c in cats} for m in modes}
    names = list(modes)
    for rep in range(reps):
        for cat, ps in cats.items():
            for i, p in enumerate(ps):
                order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no mode always runs first
                for mode in order:
                    eng.speculator = modes[mode]
                    before = modes[mode].stats.copy() if modes[mode] else None
                    out = eng.generate([p], params)[0]
                    r = res[mode][cat]
                    mine = r["by_prompt"].setdefault(i, {"tpot": [], "drafted": 0, "accepted": 0})
                    n = len(out.output_token_ids)
                    if n > 1:
                        tpot = (out.metrics.finished_time - out.metrics.first_token_time) / (n - 1)
                        r["tpot"].append(tpot)
                        mine["tpot"].append(tpot)
                    if before is not None:
                        d, a = delta(before, modes[mode].stats)
                        r["drafted"] += d
                        r["accepted"] += a
                        mine["drafted"] += d
                        mine["accepted"] += a
                    r["texts"][i] = out.text
                    mine["copied"] = copied(p, list(out.output_token_ids))
    return res


def throughput(eng: LLMEngine, modes: dict, ps: list[list[int]], concurrency: list[int], max_tokens: int,
               reps: int) -> dict:
    """Median output tokens/s per mode and concurrency: `c` requests at once (prompts cycled), each max_tokens long,
    the modes interleaved (rotated) within every repetition."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rates = {m: {c: [] for c in concurrency} for m in modes}
    texts = {m: {} for m in modes}
    names = list(modes)
    for rep in range(reps):
        for c in concurrency:
            batch = [ps[i % len(ps)] for i in range(c)]
            for mode in names[rep % len(names):] + names[:rep % len(names)]:
                eng.speculator = modes[mode]
                t = time.perf_counter()
                res = eng.generate(batch, params)
                rates[mode][c].append(sum(len(r.output_token_ids) for r in res) / (time.perf_counter() - t))
                texts[mode][c] = [r.text for r in res]
    identical = {m: sum(a == b for c in concurrency for a, b in zip(texts[m][c], texts["plain"][c]))
                 for m in modes}
    return {"tokens_per_s": {m: {c: statistics.median(v) for c, v in r.items()} for m, r in rates.items()},
            "all_tokens_per_s": rates, "identical_outputs": identical, "outputs": sum(concurrency)}


def report_batch1(b1: dict, modes: dict, cats: dict, a, top1: float | None) -> dict:
    """Print the batch-1 table (and the INT4 draft's acceptance against its probe); the numbers as a dict."""
    print(f"\nbatch 1, greedy, {a.max_tokens} tokens max, {a.reps} reps interleaved: median TPOT (ms)")
    print(f"{'category':8} {'plain':>8} " + " ".join(f"{m:>10} {'speedup':>7} {'accept':>6} {'same':>5}"
                                                     for m in modes if m != "plain"))
    summary: dict = {}
    for cat in cats:
        base = statistics.median(b1["plain"][cat]["tpot"])
        row = f"{cat:8} {base * 1e3:8.1f} "
        for m in modes:
            if m == "plain":
                continue
            r = b1[m][cat]
            med = statistics.median(r["tpot"])
            rate = r["accepted"] / r["drafted"] if r["drafted"] else float("nan")
            same = sum(r["texts"][i] == b1["plain"][cat]["texts"][i] for i in r["texts"])
            row += f"{med * 1e3:10.1f} {base / med:6.2f}x {rate:6.1%} {same}/{len(r['texts']):<3}"
            summary.setdefault(m, {})[cat] = {"tpot_ms": med * 1e3, "speedup": base / med, "acceptance": rate,
                                              "identical": same, "prompts": len(r["texts"])}
        summary.setdefault("plain", {})[cat] = {"tpot_ms": base * 1e3}
        print(row)
    print("\nper prompt (copied: share of the plain answer's 4-grams found in the prompt)")
    for cat in cats:
        for i, plain in sorted(b1["plain"][cat]["by_prompt"].items()):
            base = statistics.median(plain["tpot"])
            row = f"{cat:6} #{i} copied {plain['copied']:4.0%} plain {base * 1e3:6.1f} ms"
            for m in modes:
                if m != "plain":
                    r = b1[m][cat]["by_prompt"][i]
                    rate = r["accepted"] / r["drafted"] if r["drafted"] else float("nan")
                    row += f"  {m} {base / statistics.median(r['tpot']):5.2f}x {rate:6.1%}"
                    summary[m][cat].setdefault("by_prompt", []).append(
                        {"copied": plain["copied"], "speedup": base / statistics.median(r["tpot"]), "acceptance": rate})
            print(row)
    if top1 is not None:
        d = b1["draft-int4"]
        drafted, accepted = sum(d[c]["drafted"] for c in cats), sum(d[c]["accepted"] for c in cats)
        per_pos = modes["draft-int4"].stats.accepted_per_pos
        first = per_pos[0] / modes["draft-int4"].stats.num_drafts if per_pos else float("nan")
        print(f"\nINT4 draft: probe top-1 agreement {top1:.1%}; acceptance rate {accepted / drafted:.1%} "
              f"(first draft token accepted {first:.1%} of drafts; with per-token agreement p and k={a.draft_k}, "
              f"the rate would be (p + ... + p^k) / k = "
              f"{sum(top1 ** i for i in range(1, a.draft_k + 1)) / a.draft_k:.1%})")
        summary["draft_probe"] = {"top1": top1, "acceptance": accepted / drafted, "first_token_acceptance": first}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model reference (default: the embedded default model)")
    ap.add_argument("--store", default=str(Path.home() / ".cache/llmq/bench-speculative-store"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="n-gram draft tokens")
    ap.add_argument("--draft-k", type=int, default=3, help="draft-model draft tokens")
    ap.add_argument("--no-draft", action="store_true", help="skip the INT4 draft model")
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--conc-tokens", type=int, default=48, help="output tokens per request in the sweep")
    ap.add_argument("--skip-batch1", action="store_true", help="only the concurrency sweep")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    store = Store(Path(a.store))
    model = resolve_model(a.model, store)
    conc = [int(x) for x in a.concurrency.split(",")]
    eng = LLMEngine(model.path, EngineConfig(max_num_seqs=max(conc + [1]), speculative="ngram",
                                             num_speculative_tokens=a.k))
    ngram = eng.speculator
    modes = {"plain": None, "ngram": ngram}
    top1 = None
    if not a.no_draft:
        from llmq.pipeline.quantize import QuantizeOptions, quantize

        int4 = quantize(model, QuantizeOptions(method="rtn", bits=4, group_size=64), store, progress=False)
        top1 = (int4.metrics.get("probe") or {}).get("top1")
        modes["draft-int4"] = make_speculator(
            EngineConfig(speculative=str(int4.path), num_speculative_tokens=a.draft_k), eng)
    cats = prompts(eng.tokenizer)
    eng.speculator = None
    eng.generate([cats["chat"][0]], SamplingParams(max_tokens=4, temperature=0))  # warm up
    print(f"model {model.ref}; device {eng.device}; n-gram k={a.k}" +
          ("" if a.no_draft else f"; INT4 RTN draft k={a.draft_k} (probe top-1 agreement {top1})"))

    summary = {}
    if not a.skip_batch1:
        summary = report_batch1(batch1(eng, modes, cats, a.reps, a.max_tokens), modes, cats, a, top1)
    mixed = [p for c in ("edit", "quote", "chat") for p in cats[c]]
    backoff_off = make_speculator(EngineConfig(speculative="ngram", num_speculative_tokens=a.k,
                                               speculative_max_batch=None), eng)
    tp_modes = {"plain": None, "ngram": ngram, "ngram-no-backoff": backoff_off}
    tp = throughput(eng, tp_modes, mixed, conc, a.conc_tokens, a.reps)
    print(f"\nthroughput, {a.conc_tokens} tokens per request, mixed prompts: output tokens/s "
          f"(back-off above {ngram.max_batch} running)")
    print(f"{'conc':>4} {'plain':>8} {'ngram':>8} {'ratio':>6} {'no-backoff':>10} {'ratio':>6}")
    for c in conc:
        p = tp["tokens_per_s"]["plain"][c]
        n, nb = tp["tokens_per_s"]["ngram"][c], tp["tokens_per_s"]["ngram-no-backoff"][c]
        print(f"{c:4d} {p:8.1f} {n:8.1f} {n / p:6.2f} {nb:10.1f} {nb / p:6.2f}")
    print("greedy outputs identical to plain: " + ", ".join(f"{m} {v}/{tp['outputs']}"
                                                            for m, v in tp["identical_outputs"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"batch1": summary, "throughput": tp, "k": a.k, "draft_k": a.draft_k,
                                            "model": model.ref, "reps": a.reps}, indent=1))
    eng.shutdown()
    for m in modes.values():
        if m is not None:
            m.close()


if __name__ == "__main__":
    main()
