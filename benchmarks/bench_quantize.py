"""Time, peak memory and quality of every `llmq quantize` method on one model, in one run, as a table.

Each configuration runs `llmq quantize ... --json` in its own process (so peak RSS is that run's alone) against the
same imported model (default: the embedded SmolLM2-135M-Instruct) with the same calibration and probe settings.
Printed per run: wall time, peak RSS, checkpoint size and its ratio to bf16 (whole file and quantized linears
only), and the probe's mean KL divergence and top-1 agreement against the source model. The issue's bars are checked
in the same run: INT8 weight-only top-1 >= 98%, INT4 GPTQ KLD < INT4 RTN KLD; and bitsandbytes' NF4 is set against
INT4 RTN / GPTQ at equal bits (KLD and bytes of the quantized linears).

    python benchmarks/bench_quantize.py [--model REF] [--store DIR] [--only rtn-w8,gptq-w4,...]
        [--num-samples 32] [--seq-len 256] [--probe-tokens 2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.artifacts import Store  # noqa: E402
from llmq.models import resolve_model  # noqa: E402

CONFIGS = {
    "rtn-w8": ["--method", "rtn", "--bits", "8"],
    "rtn-w8-g32": ["--method", "rtn", "--bits", "8", "--group-size", "32"],
    "gptq-w8": ["--method", "gptq", "--bits", "8"],
    "rtn-w4": ["--method", "rtn", "--bits", "4"],
    "rtn-w4-asym": ["--method", "rtn", "--bits", "4", "--asym"],
    "gptq-w4": ["--method", "gptq", "--bits", "4"],
    "gptq-w4-act": ["--method", "gptq", "--bits", "4", "--act-order"],
    "awq-w4": ["--method", "awq", "--bits", "4"],
    "autoround-w4-light": ["--method", "autoround", "--bits", "4", "--iters", "50"],
    "autoround-w4": ["--method", "autoround", "--bits", "4"],
    "smoothquant-w8a8": ["--method", "smoothquant", "--bits", "8"],
    "fp8": ["--method", "fp8", "--bits", "8"],
    "bnb-nf4": ["--method", "bnb-nf4"],
    "bnb-nf4-dq": ["--method", "bnb-nf4", "--double-quant"],
    "bnb-int8": ["--method", "bnb-int8"],
}


def run_one(store: Path, model: str, key: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "llmq", "--store", str(store), "quantize", model, *CONFIGS[key], *extra,
           "--name", f"bench-{key}", "--json"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"key": key, "error": (p.stderr.strip().splitlines() or ["failed"])[-1][:120]}
    man = json.loads(p.stdout)
    m = man["metrics"]
    return {"key": key, "scheme": man["config"]["scheme"], "process_s": wall, "wall_s": m["wall_time_s"],
            "peak_rss": m["peak_rss_bytes"], "size": m["size_bytes"], "ratio_bf16": m["ratio_vs_bf16"],
            "linear_ratio_bf16": m["linear_ratio_vs_bf16"], "kld": m["probe"]["kld_mean"],
            "top1": m["probe"]["top1"], "probe_tokens": m["probe"]["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model reference (default: the embedded default model)")
    ap.add_argument("--store", default=None, help="artifact store (default: a temporary one)")
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--probe-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    store_dir = Path(args.store or tempfile.mkdtemp(prefix="llmq-bench-quantize-"))
    source = resolve_model(args.model, Store(store_dir))
    extra = ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
             "--probe-tokens", str(args.probe_tokens)]
    rows = []
    for key in args.only.split(","):
        rows.append(run_one(store_dir, str(source.path), key, extra))
        print(json.dumps(rows[-1]), file=sys.stderr)

    table = Table(title=f"llmq quantize on {source.ref}: calibration {args.num_samples} x {args.seq_len} tokens, "
                        f"probe {args.probe_tokens} tokens")
    for col in ("config", "scheme", "wall s", "peak RSS MiB", "size MiB", "x vs bf16", "linears x vs bf16",
                "KLD mean", "top-1 %"):
        table.add_column(col, justify="left" if col in ("config", "scheme") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["key"], f"[red]{r['error']}[/red]", *[""] * 7)
            continue
        table.add_row(r["key"], r["scheme"], f"{r['wall_s']:.1f}", f"{r['peak_rss'] / 2**20:.0f}",
                      f"{r['size'] / 2**20:.1f}", f"{r['ratio_bf16']:.2f}", f"{r['linear_ratio_bf16']:.2f}",
                      f"{r['kld']:.5f}", f"{100 * r['top1']:.2f}")
    console = Console()
    (console if console.is_terminal else Console(width=160)).print(table)
    ok = {r["key"]: r for r in rows if "error" not in r}
    for key in ("rtn-w8", "rtn-w8-g32"):
        if key in ok:
            print(f"INT8 {key} top-1 {100 * ok[key]['top1']:.2f}% (bar: >= 98%)")
    if "rtn-w4" in ok and "gptq-w4" in ok:
        r, g = ok["rtn-w4"]["kld"], ok["gptq-w4"]["kld"]
        print(f"INT4 KLD: GPTQ {g:.5f} vs RTN {r:.5f} ({r / g:.2f}x lower with GPTQ; bar: GPTQ < RTN)")
    for nf4 in ("bnb-nf4", "bnb-nf4-dq"):
        for int4 in ("rtn-w4", "gptq-w4"):
            if nf4 in ok and int4 in ok:
                a, b = ok[nf4], ok[int4]
                print(f"{nf4} vs {int4}: KLD {a['kld']:.5f} vs {b['kld']:.5f} ({b['kld'] / a['kld']:.2f}x), linears "
                      f"{a['linear_ratio_bf16']:.2f}x vs {b['linear_ratio_bf16']:.2f}x smaller than bf16")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
