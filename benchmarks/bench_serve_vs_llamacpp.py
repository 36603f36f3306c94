"""Serving side by side: llama-server and `llmq serve`, loaded by the same client (`llmq bench serve`), in one run.

Both servers run on this machine on the same --threads cores (pinned with taskset when fewer than the process may
use), one at a time (the other stopped), each level
interleaved: for every concurrency level and round, llama-server then llmq, the same synthetic prompts (same seed,
prompt and output lengths, ignore_eos so every request generates --output-len tokens). llama-server serves a GGUF
(`--gguf FILE`, or the GGUF of an llmq engine artifact `--gguf REF`) with `-np` = the highest level and a context of
levels x (prompt + output) tokens; llmq serves `--llmq REF`. Printed: output tokens/s, TTFT p50 and TPOT p50 per
server and level (medians over --rounds), and the ratio llmq / llama-server.

    python benchmarks/bench_serve_vs_llamacpp.py --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --gguf smollm2-135m-instruct-gptq-g32-tp1-gguf --llmq smollm2-135m-instruct-gptq-g32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bench.llamacpp import LlamaCppNotFound, locate, stop  # noqa: E402
from llmq.errors import LlmqError  # noqa: E402

LLMQ = [sys.executable, "-m", "llmq"]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise LlmqError(f"the server exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise LlmqError(f"{url} not ready in {timeout:.0f} s")


@contextmanager
def server(cmd: list[str], url: str, log: Path):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, proc, 600)
            yield
        finally:
            stop(proc)


def bench(url: str, level: int, a, tokenizer: str) -> dict:
    """One closed-loop level with `llmq bench serve`: its summary."""
    cmd = [*LLMQ, "bench", "serve", "--endpoint", url, "--concurrency", str(level), "--num-prompts",
           str(max(a.num_prompts, level)), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--tokenizer", tokenizer, "--seed", str(a.seed), "--warmup", str(min(level, 4)), "--no-save", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.time_limit + 120)
    if out.returncode:
        raise LlmqError(f"llmq bench serve failed: {out.stderr.strip().splitlines()[-1:]}")
    report = json.loads(out.stdout[out.stdout.index("{"):])
    return report["levels"][0]["summary"]


def gguf_path(ref: str, store: str | None) -> tuple[str, str]:
    """(GGUF file, tokenizer source) for a file or an llmq engine artifact of --target gguf."""
    if Path(ref).is_file():
        return ref, ref
    from llmq.artifacts import Store
    from llmq.artifacts.store import default_store_path

    art = Store(Path(store) if store else default_store_path()).resolve(ref)
    files = sorted(art.path.glob("*.gguf"))
    files = [f for f in files if not f.name.endswith(".imatrix.gguf")]
    if len(files) != 1:
        raise LlmqError(f"{ref}: expected one .gguf model file, found {[f.name for f in files]}")
    return str(files[0]), str(art.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree or build/bin (or $LLAMA_CPP_DIR)")
    ap.add_argument("--gguf", required=True, help="GGUF file, or an llmq engine artifact of --target gguf")
    ap.add_argument("--llmq", required=True, help="the artifact `llmq serve` serves")
    ap.add_argument("--store", default=os.environ.get("LLMQ_STORE"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per level (at least the level)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds a level may take")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--llmq-serve-args", default="", help="extra `llmq serve` arguments, one string")
    ap.add_argument("--work-dir", default="/tmp/bench-serve-vs-llamacpp", help="server logs")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args()
    try:
        lcpp = locate(a.llama_cpp)
    except LlamaCppNotFound as e:
        sys.exit(f"error: {e}")
    gguf, tokenizer = gguf_path(a.gguf, a.store)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{a.port}"
    top = max(a.concurrency)
    store = ["--store", a.store] if a.store else []
    servers = {
        "llama-server": [lcpp.tool("llama-server"), "-m", gguf, "-t", str(a.threads), "-tb", str(a.threads),
                         "-np", str(top), "-c", str(top * (a.input_len + a.output_len + 16)), "--host", "127.0.0.1",
                         "--port", str(a.port), "--no-webui"],
        "llmq serve": [*LLMQ, *store, "serve", a.llmq, "--host", "127.0.0.1", "--port", str(a.port),
                       *a.llmq_serve_args.split()],
    }
    # both pinned to the same cores (llmq's runtime takes one thread per core it may run on; llama-server gets -t)
    pin = ["taskset", "-c", f"0-{a.threads - 1}"] if a.threads < len(os.sched_getaffinity(0)) else []
    servers = {name: pin + cmd for name, cmd in servers.items()}
    results: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in a.concurrency} for s in servers}
    print(f"llama-server on {gguf}; llmq serve on {a.llmq}; {a.threads} threads; prompts {a.input_len} tokens, "
          f"{a.output_len} out; levels {a.concurrency}; {a.rounds} round(s)", flush=True)
    for r in range(a.rounds):
        for c in a.concurrency:
            for name, cmd in servers.items():
                with server(cmd, url, work / f"{name.replace(' ', '-')}.log"):
                    s = bench(url, c, a, tokenizer)
                results[name][c].append(s)
                print(f"round {r + 1} c={c} {name}: {s['output_throughput']:.1f} out tok/s, TTFT p50 "
                      f"{1e3 * s['ttft']['p50']:.0f} ms, TPOT p50 {1e3 * s['tpot']['p50']:.1f} ms", flush=True)

    def med(name, c, key):
        vals = [s[key] if key == "output_throughput" else s[key]["p50"] for s in results[name][c]]
        return statistics.median(vals)

    print("\n| concurrency | llama-server out tok/s | llmq serve out tok/s | ratio | TTFT p50 llama / llmq ms | "
          "TPOT p50 llama / llmq ms |")
    print("|---|---|---|---|---|---|")
    rows = []
    for c in a.concurrency:
        ll, lq = med("llama-server", c, "output_throughput"), med("llmq serve", c, "output_throughput")
        row = {"concurrency": c, "llama_server": ll, "llmq": lq, "ratio": lq / ll,
               "ttft_p50_ms": [1e3 * med("llama-server", c, "ttft"), 1e3 * med("llmq serve", c, "ttft")],
               "tpot_p50_ms": [1e3 * med("llama-server", c, "tpot"), 1e3 * med("llmq serve", c, "tpot")]}
        rows.append(row)
        print(f"| {c} | {ll:.1f} | {lq:.1f} | {lq / ll:.2f} | {row['ttft_p50_ms'][0]:.0f} / "
              f"{row['ttft_p50_ms'][1]:.0f} | {row['tpot_p50_ms'][0]:.1f} / {row['tpot_p50_ms'][1]:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "gguf": gguf, "rows": rows, "runs": results},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
