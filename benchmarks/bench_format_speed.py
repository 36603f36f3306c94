"""Batch-1 decode speed of bitsandbytes' NF4 / LLM.int8 artifacts against llmq's INT4 / INT8 RTN ones, in one run.

Each artifact is made by `llmq quantize` from the same model (default: the embedded SmolLM2-135M-Instruct) and run
by the bundled runtime (the engine `llmq serve` runs): steady-state decode steps of one sequence after a 128-token
prefill, repeated --repeats times; the median tokens/s and its ratio to INT4 RTN g64 (the baseline, measured in the
same run) are printed, with the best run (the least disturbed on a shared machine). "nf4-torch" is the NF4 artifact
with bitsandbytes' dequantize kernel switched off (the runtime's exact torch fallback, what runs where bitsandbytes
is not installed).

    python benchmarks/bench_bnb_decode.py [--model REF] [--store DIR] [--steps 32] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_throughput import batch1_decode, make_prompts  # noqa: E402

from llmq.artifacts import Store  # noqa: E402
from llmq.bench.hw import read_bandwidth  # noqa: E402
from llmq.models import bnbformat, resolve_model  # noqa: E402
from llmq.models.checkpoint import read_config  # noqa: E402
from llmq.pipeline.quantize import QuantizeOptions, quantize  # noqa: E402

VARIANTS = {
    "int4-rtn-g64": QuantizeOptions(bits=4, group_size=64),
    "nf4": QuantizeOptions(method="bnb-nf4"),
    "nf4-dq": QuantizeOptions(method="bnb-nf4", double_quant=True),
    "int8-rtn": QuantizeOptions(bits=8, group_size=0),
    "llm-int8": QuantizeOptions(method="bnb-int8"),
}
BASELINE = "int4-rtn-g64"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model reference (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    store = Store.open(args.store)
    model = resolve_model(args.model, store)
    paths = {k: quantize(model, dataclasses.replace(o, probe_tokens=0), store, progress=False).path
             for k, o in VARIANTS.items()}
    paths["nf4-torch"] = paths["nf4"]
    peak = read_bandwidth("cpu", 1 << 30)  # llmq bench hw's measurement, over a 1 GiB buffer, now
    prompt = make_prompts(1, 128, read_config(model.path)["vocab_size"])[0]
    kernels = bnbformat.kernels
    runs: dict[str, list[dict]] = {k: [] for k in paths}
    for _ in range(args.repeats):  # interleaved, so a load change on the machine hits every variant alike
        for name, path in paths.items():
            bnbformat.kernels = (lambda: None) if name == "nf4-torch" else kernels
            runs[name].append(batch1_decode(path, prompt, args.steps, peak))
    bnbformat.kernels = kernels
    base = statistics.median(r["tokens_per_s"] for r in runs[BASELINE])
    print(f"model {model.ref}  threads {torch.get_num_threads()}  peak read {peak / 1e9:.1f} GB/s  "
          f"median of {args.repeats} x {args.steps} decode steps")
    print(f"{'weights':>13} {'tok/s':>7} {'vs int4':>8} {'best':>7} {'MB/step':>8} {'MBU':>6}")
    out = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        mb = (rs[0]["weight_bytes"] + rs[0]["kv_bytes"]) / 1e6
        mbu = statistics.median(r["mbu"] for r in rs)
        out[name] = {"tokens_per_s": tps, "ratio_vs_int4_rtn": tps / base, "mb_per_step": mb, "mbu": mbu,
                     "all_tokens_per_s": [r["tokens_per_s"] for r in rs]}
        best = max(r["tokens_per_s"] for r in rs)
        print(f"{name:>13} {tps:>7.1f} {tps / base:>7.2f}x {best:>7.1f} {mb:>8.1f} {mbu:>6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
