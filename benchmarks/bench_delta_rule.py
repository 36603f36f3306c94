"""The Gated DeltaNet decode recurrence on CPU: llmq's delta_rule_step kernel (the states updated in their pool
slots, two passes over each head's state) against the eager path it replaced (gather the slots, delta_rule.step's
five tensor operations, scatter back), in one run, interleaved call by call.

Shapes: Qwen3.5's (16 value heads, keys and values of 128: a 1 MiB float32 state per sequence and layer), a pool of
64 slots, B decodes on scattered slots; the median of --reps calls of each, microseconds per layer step, and the
state bytes a step touches per microsecond (read and written once: what the kernel's two passes over a cached head
cost from memory).

    python benchmarks/bench_delta_rule.py [--batch 1 8 32] [--threads 1 2] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bench.hw import machine_key  # noqa: E402
from llmq.runtime.layers import cpu_kernels, delta_rule  # noqa: E402

HEADS, DK, DV, SLOTS = 16, 128, 128, 64


def eager(pool, slots, q, k, v, g, beta):
    state = pool[slots]
    o = delta_rule.step(state, q, k, v, g, beta)
    pool[slots] = state
    return o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not cpu_kernels.available():
        print("llmq's CPU kernels are not built here", file=sys.stderr)
        return 2
    print(f"CPU: {machine_key('cpu')}; {HEADS} heads of {DK} x {DV}, pool of {SLOTS}; median of {a.reps}")
    print(f"{'threads':>7} {'batch':>5} {'eager us':>9} {'kernel us':>9} {'speedup':>7} {'kernel GB/s':>11}")
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(SLOTS, HEADS, DK, DV, generator=gen) * 0.1
    for t in a.threads:
        torch.set_num_threads(t)
        for b in a.batch:
            slots = torch.randperm(SLOTS, generator=gen)[:b]
            q, k = (torch.nn.functional.normalize(torch.randn(b, HEADS, DK, generator=gen), dim=-1) for _ in "qk")
            v = torch.randn(b, HEADS, DV, generator=gen)
            g, beta = -torch.rand(b, HEADS, generator=gen), torch.rand(b, HEADS, generator=gen)
            times = {"eager": [], "kernel": []}
            for _ in range(a.reps):
                for name, fn in (("eager", eager), ("kernel", cpu_kernels.delta_rule_step)):
                    t0 = time.perf_counter()
                    fn(pool, slots, q, k, v, g, beta)
                    times[name].append(time.perf_counter() - t0)
            e, kk = (statistics.median(times[n]) * 1e6 for n in ("eager", "kernel"))
            touched = 2 * b * HEADS * DK * DV * 4   # each state read and written once
            print(f"{t:>7} {b:>5} {e:>9.1f} {kk:>9.1f} {e / kk:>6.2f}x {touched / kk / 1e3:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
