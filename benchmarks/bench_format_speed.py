"""Batch-1 decode and prefill speed of every weight format llmq writes, against INT4 RTN g32 in one run.

Each artifact is made by `llmq quantize` from the same model (default: the embedded SmolLM2-135M-Instruct) and run by
the bundled runtime (the engine `llmq serve` runs), with --threads threads:
- decode: steady-state steps of one sequence after a --prompt-len-token prefill (tokens/s);
- prefill: one --prompt-len-token prompt on a warmed engine (tokens/s).
Variants are interleaved round by round (--repeats), so a load change on the shared machine hits each alike; the
median and its ratio to INT4 RTN g32 (the baseline) are printed, with MB read a decode step and MBU. Issue 53's
target: every format >= 0.8x INT4 on both.

    python benchmarks/bench_format_speed.py [--model REF] [--store DIR] [--formats NAME ...] [--threads 1]
        [--steps 32] [--prompt-len 128] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_throughput import batch1_decode, make_prompts  # noqa: E402

from llmq.artifacts import Store  # noqa: E402
from llmq.bench.hw import machine_key, read_bandwidth  # noqa: E402
from llmq.models import resolve_model  # noqa: E402
from llmq.models.checkpoint import read_config  # noqa: E402
from llmq.pipeline.quantize import QuantizeOptions, quantize  # noqa: E402
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

VARIANTS = {
    "int4-g32": QuantizeOptions(bits=4, group_size=32),
    "int5-g32": QuantizeOptions(bits=5, group_size=32),
    "int8": QuantizeOptions(bits=8, group_size=0),
    "int8-g32": QuantizeOptions(bits=8, group_size=32),
    "q4_k": QuantizeOptions(bits=4, grid="q4_k"),
    "iq4_xs": QuantizeOptions(bits=4, grid="iq4_xs"),
    "nvfp4": QuantizeOptions(method="nvfp4"),
    "mxfp4": QuantizeOptions(method="mxfp4"),
    "fp8-block": QuantizeOptions(method="fp8", group_size=128),
    "nf4": QuantizeOptions(method="bnb-nf4"),
    "llm-int8": QuantizeOptions(method="bnb-int8"),
}
BASELINE = "int4-g32"


def prefill_tokens_per_s(path: Path, prompts: list[list[int]]) -> float:
    """Tokens/s of prefilling prompts[1] on an engine that prefilled prompts[0] first (warm: the first call's
    one-time costs are not the format's)."""
    engine = LLMEngine(path, EngineConfig(max_num_seqs=1, max_num_batched_tokens=len(prompts[1])))
    try:
        engine.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0))
        engine.add_request("p", prompts[1], SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        while "p" in engine.requests and engine.requests["p"].num_computed_tokens < len(prompts[1]):
            engine.step()   # the step that ends the prefill samples its one token and retires the request
        return len(prompts[1]) / (time.perf_counter() - t)
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model reference (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--formats", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    store = Store.open(args.store)
    model = resolve_model(args.model, store)
    names = [BASELINE] + [f for f in args.formats if f != BASELINE]
    paths = {k: quantize(model, dataclasses.replace(VARIANTS[k], probe_tokens=0), store, progress=False).path
             for k in names}
    peak = read_bandwidth("cpu", 1 << 30)  # llmq bench hw's measurement, over a 1 GiB buffer, now
    prompts = make_prompts(3, args.prompt_len, read_config(model.path)["vocab_size"])
    runs: dict[str, list[dict]] = {k: [] for k in paths}
    for _ in range(args.repeats):
        for name, path in paths.items():
            run = batch1_decode(path, prompts[0], args.steps, peak)
            run["prefill_tokens_per_s"] = prefill_tokens_per_s(path, prompts[1:])
            runs[name].append(run)
    med = {k: {m: statistics.median(r[m] for r in rs) for m in ("tokens_per_s", "prefill_tokens_per_s", "mbu")}
           for k, rs in runs.items()}
    base = med[BASELINE]
    cpu = machine_key("cpu")
    print(f"{cpu}  model {model.ref}  threads {args.threads}  peak read {peak / 1e9:.1f} GB/s  median of "
          f"{args.repeats}: {args.steps} decode steps after a {args.prompt_len}-token prefill; prefill of "
          f"{args.prompt_len} tokens")
    print(f"{'weights':>10} {'decode tok/s':>12} {'vs int4':>8} {'prefill tok/s':>13} {'vs int4':>8} {'MB/step':>8} "
          f"{'MBU':>6}")
    out = {}
    for name, rs in runs.items():
        m = med[name]
        mb = (rs[0]["weight_bytes"] + rs[0]["kv_bytes"]) / 1e6
        out[name] = {**m, "decode_vs_int4": m["tokens_per_s"] / base["tokens_per_s"],
                     "prefill_vs_int4": m["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], "mb_per_step": mb}
        print(f"{name:>10} {m['tokens_per_s']:>12.1f} {out[name]['decode_vs_int4']:>7.2f}x "
              f"{m['prefill_tokens_per_s']:>13.0f} {out[name]['prefill_vs_int4']:>7.2f}x {mb:>8.1f} {m['mbu']:>6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu, "threads": args.threads, "formats": out},
                                              indent=2))


if __name__ == "__main__":
    main()
