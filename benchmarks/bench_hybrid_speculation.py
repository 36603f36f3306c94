"""What rolling a hybrid model's recurrent states back costs speculative decoding, in one run on one engine.

A Qwen3.5-shaped hybrid at real layer width (bench_hybrid_vs_llamacpp's shape: DeltaNet states of 16 heads of 128 x
128, float32; random bf16 weights, --layers of its 3:1 pattern) decodes greedily, its speculator swapped prompt by
prompt between none and a proposer of the true greedy continuation (tests/helpers.Oracle) whose drafts are all right
or, in a share --wrong of them, wrong at one random position: every wrong draft makes each DeltaNet layer restore the
state it journaled before the verify step and replay the accepted tokens' recurrence. So the proposer's quality is out
of the picture and what is measured is the mechanism: per output token, the time of plain decoding and of each mode,
and the share of a speculating step spent journaling (state snapshots, recorded inputs) and rolling back (restore and
replay). Greedy outputs are checked identical to plain decoding's.

    python benchmarks/bench_hybrid_speculation.py --work /tmp/hybrid-spec [--layers 8] [--k 4] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_hybrid_vs_llamacpp import SHAPE  # noqa: E402
from helpers import Oracle  # noqa: E402

from llmq.runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from llmq.runtime.models.linear_attention import GatedDeltaNet  # noqa: E402
from llmq.runtime.speculative import SpecStats, Speculator  # noqa: E402

SPENT: collections.Counter = collections.Counter()   # seconds in the journal's methods, by name


def timed(name: str):
    f = getattr(GatedDeltaNet, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t
    setattr(GatedDeltaNet, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="directory for the checkpoint")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="draft tokens a step")
    ap.add_argument("--wrong", type=float, default=0.5, help="share of drafts with a wrong token")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="sequences decoding together")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    model = a.work / f"qwen35-hybrid-{a.layers}layers"
    if not model.is_dir():
        from bench_moe_real_width import make_checkpoint

        from llmq.artifacts import Store
        from llmq.models import resolve_model

        make_checkpoint(model, SHAPE, a.layers, resolve_model(None, Store.open(a.work / "store")).path)
    for name in ("_journals", "_record"):
        timed(name)
    eng = LLMEngine(model, EngineConfig(max_model_len=512, max_num_batched_tokens=512, max_num_seqs=max(a.batch),
                                        speculative="ngram", speculative_max_batch=None,
                                        num_speculative_tokens=a.k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist() for _ in range(max(a.batch))]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    eng.speculator = None
    truth = {tuple(p): o.output_token_ids for p, o in zip(prompts, eng.generate(prompts, params))}
    modes = {"plain": None,
             "all right": Speculator(Oracle(truth, wrong=0.0), a.k, None),
             f"{a.wrong:.0%} wrong": Speculator(Oracle(truth, wrong=a.wrong), a.k, None)}
    rows = []
    print(f"{a.layers} layers ({a.layers - a.layers // 4} Gated DeltaNet), k = {a.k}, {a.max_tokens} tokens a "
          f"sequence, {torch.get_num_threads()} threads")
    print("| batch | mode | ms / output token | vs plain | accepted | journal + rollback share | greedy identical |")
    print("|---|---|---|---|---|---|---|")
    for batch in a.batch:
        times = {m: [] for m in modes}
        same = dict.fromkeys(modes, True)
        shares = {m: [] for m in modes}
        for spec in modes.values():
            if spec is not None:
                spec.stats = SpecStats()
        for rep in range(a.reps):
            for lo in range(0, len(prompts) - batch + 1, batch):
                group = prompts[lo:lo + batch]
                for m, spec in modes.items():
                    eng.speculator = spec
                    SPENT.clear()
                    t = time.perf_counter()
                    out = eng.generate(group, params)
                    dt = time.perf_counter() - t
                    times[m].append(dt / (batch * a.max_tokens) * 1e3)
                    shares[m].append(sum(SPENT.values()) / dt)
                    same[m] &= all(o.output_token_ids == truth[tuple(p)] for p, o in zip(group, out))
        plain = statistics.median(times["plain"])
        for m, spec in modes.items():
            ms = statistics.median(times[m])
            acc = f"{spec.stats.acceptance_rate:.2f}" if spec else "-"
            row = dict(batch=batch, mode=m, ms_per_token=round(ms, 2), vs_plain=round(plain / ms, 2),
                       acceptance=acc, journal_share=round(statistics.median(shares[m]), 4), identical=same[m])
            rows.append(row)
            print(f"| {batch} | {m} | {ms:.2f} | {plain / ms:.2f}x | {acc} | {row['journal_share']:.1%} | "
                  f"{same[m]} |")
    eng.speculator = None
    eng.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
