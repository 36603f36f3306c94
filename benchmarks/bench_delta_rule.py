"""A Gated DeltaNet layer's decode rows on CPU, between its two projections: llmq's gated_delta_decode kernel (the
convolution tails and states updated in their pool slots, one call) against the layer's PyTorch operations (gather
the slots, the convolution, the key / query normalization, delta_rule.step, the gated norm, scatter back), in one
run, interleaved call by call.

Shapes: Qwen3.5's (16 key and 16 value heads, keys and values of 128: a 1 MiB float32 state per sequence and layer;
convolution kernel 4), float32 compute, a pool of 64 slots, B decodes on scattered slots; the median of --reps calls
of each, microseconds per layer step, and the state bytes a step touches per microsecond (read and written once).

    python benchmarks/bench_delta_rule.py [--batch 1 8 32] [--threads 1 2] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bench.hw import machine_key  # noqa: E402
from llmq.runtime.kv_cache import LayerRecurrent  # noqa: E402
from llmq.runtime.layers import cpu_kernels  # noqa: E402
from llmq.runtime.models.linear_attention import GatedDeltaNet  # noqa: E402

KEY_HEADS, HEADS, DK, DV, KERNEL, SLOTS = 16, 16, 128, 128, 4, 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not cpu_kernels.available():
        print("llmq's CPU kernels are not built here", file=sys.stderr)
        return 2
    print(f"CPU: {machine_key('cpu')}; {KEY_HEADS} key / {HEADS} value heads of {DK} x {DV}, pool of {SLOTS}; "
          f"median of {a.reps}")
    print(f"{'threads':>7} {'batch':>5} {'eager us':>9} {'kernel us':>9} {'speedup':>7} {'kernel GB/s':>11}")
    gen = torch.Generator().manual_seed(0)
    channels = 2 * KEY_HEADS * DK + HEADS * DV
    layer = GatedDeltaNet(None, None, torch.randn(channels, 1, KERNEL, generator=gen) * 0.5,
                          torch.rand(HEADS, generator=gen), torch.randn(HEADS, generator=gen),
                          torch.rand(DV, generator=gen) + 0.5, 1e-6, KEY_HEADS, HEADS, DK, DV)
    cache = LayerRecurrent(SLOTS, channels, KERNEL, HEADS, DK, DV, torch.float32, "cpu")
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.1)

    def eager(mixed, slots, g, beta):
        with mock.patch.object(cpu_kernels, "usable", lambda t: False):
            return layer._decodes(mixed, cache, slots, g, beta)

    def kernel(mixed, slots, g, beta):
        return layer._decodes(mixed, cache, slots, g, beta)

    for t in a.threads:
        torch.set_num_threads(t)
        for b in a.batch:
            slots = torch.randperm(SLOTS, generator=gen)[:b]
            mixed = torch.randn(b, channels + HEADS * DV + 2 * HEADS, generator=gen)
            beta = mixed[:, -2 * HEADS:-HEADS].sigmoid()
            g = layer.neg_rate * torch.nn.functional.softplus(mixed[:, -HEADS:] + layer.dt_bias)
            times = {"eager": [], "kernel": []}
            for _ in range(a.reps):
                for name, fn in (("eager", eager), ("kernel", kernel)):
                    t0 = time.perf_counter()
                    fn(mixed, slots, g, beta)
                    times[name].append(time.perf_counter() - t0)
            e, kk = (statistics.median(times[n]) * 1e6 for n in ("eager", "kernel"))
            touched = 2 * b * HEADS * DK * DV * 4   # each state read and written once
            print(f"{t:>7} {b:>5} {e:>9.1f} {kk:>9.1f} {e / kk:>6.2f}x {touched / kk / 1e3:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
