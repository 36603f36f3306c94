"""llmq's CPU products (runtime/layers/cpu_kernels: INT4 / INT8 lowbit_linear_bf16 and Q4_K q4k_linear on 16-bit
activations, NVFP4 fp4_linear, bfloat16 / float16 dense16_linear and bitsandbytes NF4 table_linear on float32 ones, NF4
also with bfloat16 weights and activations) on the tile unit (AMX-BF16) against the vector paths (vdpbf16ps; float32
FMAs for FP4, NF4 and 16-bit weights) in one run, on the default model's layer shapes.

For each format, thread count and row count M: the median time of one call on every projection of a SmolLM2-135M
layer (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; INT4 in groups of 32, INT8 per channel, NVFP4 in its
blocks of 16, Q4_K in its sub-blocks of 32 on every shape, NF4 in blocks of 64), as G multiply-adds a second, with
AMX on, then off (cpu_kernels.amx), interleaved call by call, and the ratio. Where Linux does not grant the AMX tile
state (or the CPU has none) both columns are the vector path and it says so.

    python benchmarks/bench_lowbit_products.py [--formats int4 int8 nvfp4 bf16 f16 q4k nf4 nf4-bf16]
        [--rows 1 8 16 32 64 128]
        [--threads 1 2] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq import quant  # noqa: E402
from llmq.bench.hw import machine_key  # noqa: E402
from llmq.runtime.layers import cpu_kernels  # noqa: E402

DENSE = {"bf16": torch.bfloat16, "f16": torch.float16}  # 16-bit weights as stored: dense16_linear
NF4 = {"nf4": torch.float32, "nf4-bf16": torch.bfloat16}  # the weights' (and activations') dtype: table_linear
FORMATS = ["int4", "int8", "nvfp4", *DENSE, "q4k", *NF4]
NF4_CODE = torch.linspace(-1, 1, 16)  # any 16 values: the kernel's cost does not depend on them
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def packed(fmt: str, gen: torch.Generator) -> list[tuple]:
    """Every projection's packed weight: (codes, s, group, n, k); Q4_K's s is (scales, mins)."""
    out = []
    for n, k in SHAPES.values():
        if fmt in ("bf16", "f16"):
            group, s, codes = 0, None, torch.randn(n, k, generator=gen).to(DENSE[fmt])
        elif fmt == "q4k":
            group = 32
            codes, *s = cpu_kernels.pack_q4k(torch.randint(0, 16, (n, k), generator=gen),
                                             torch.rand(n, k // group, generator=gen) * 0.01,
                                             torch.rand(n, k // group, generator=gen) * 0.01)
        elif fmt in NF4:
            group, s = 64, cpu_kernels.pack_scales(torch.rand(n, k // 64, generator=gen) * 0.1).float()
            codes = cpu_kernels.pack_codes(torch.randint(0, 16, (n, k), generator=gen), 4)
        elif fmt == "nvfp4":
            group = 16
            e4m3 = torch.randint(8, 120, (n, k // group), generator=gen).to(torch.uint8).view(torch.float8_e4m3fn)
            s = cpu_kernels.pack_scales(quant.fp4_block_scale(e4m3))
            codes = cpu_kernels.pack_codes(torch.randint(0, 16, (n, k), generator=gen), 4)
        else:
            bits = int(fmt[3:])
            group = 32 if bits == 4 else k
            q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (n, k), generator=gen)
            scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).bfloat16().float()
            codes, s, _ = cpu_kernels.pack(q, scale, None, bits)
        out.append((codes, s, group, n, k))
    return out


def layer_seconds(weights: list[tuple], x: dict[int, torch.Tensor], fmt: str) -> float:
    t = time.perf_counter()
    for codes, s, group, _, k in weights:
        if s is None:
            cpu_kernels.dense16_linear(x[k], codes)
        elif fmt == "nvfp4":
            cpu_kernels.fp4_linear(x[k], codes, s, group, 448.0 * 6.0)
        elif fmt == "q4k":
            cpu_kernels.q4k_linear(x[k], codes, *s)
        elif fmt in NF4:
            cpu_kernels.table_linear(x[k], codes, s, NF4_CODE, group, NF4[fmt])
        else:
            cpu_kernels.lowbit_linear_bf16(x[k], codes, s, int(fmt[3:]), group)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit("llmq's CPU kernels are not built here")
    granted = cpu_kernels.amx(True)
    print(f"CPU: {machine_key('cpu')}; AMX-BF16 granted: {granted}")
    gen = torch.Generator().manual_seed(0)
    print(f"{'format':>6} {'thr':>3} {'M':>4} {'AMX GMAC/s':>11} {'vector GMAC/s':>14} {'ratio':>6}")
    for fmt in args.formats:
        weights = packed(fmt, gen)
        macs = sum(n * k for *_, n, k in weights)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for m in args.rows:
                x = {k: torch.randn(m, k, generator=gen).to(NF4.get(fmt, torch.float32))
                     for k in {w[4] for w in weights}}
                times: dict[bool, list[float]] = {True: [], False: []}
                for rep in range(args.reps + 2):
                    for on in (True, False):
                        cpu_kernels.amx(on)
                        dt = layer_seconds(weights, x, fmt)
                        if rep >= 2:  # warm-up
                            times[on].append(dt)
                rate = {on: m * macs / statistics.median(t) / 1e9 for on, t in times.items()}
                print(f"{fmt:>6} {threads:>3} {m:>4} {rate[True]:>11.1f} {rate[False]:>14.1f} "
                      f"{rate[True] / rate[False]:>6.2f}", flush=True)
    cpu_kernels.amx(True)


if __name__ == "__main__":
    main()
