"""The agent tasks (tools, json, chat) on the same weights in llmq's runtime and in llama-server, side by side.

`llmq eval --endpoint` against llama-server (`--jinja`) serving a GGUF of the same weights, with `--baseline REF`:
the same tasks on REF in llmq's runtime, in process (reused when an earlier eval of REF with these settings holds
them): the packaged default model's own GGUF beside its import, or the `llmq build --target gguf` export beside the
artifact it was written from. Both runs render the prompts with llmq's chat-template code and send llama-server the
token ids (`/v1/completions`), so a difference is the engines' numerics (and llama-server's greedy path), not the
prompts. Prints every group's and task's score from each and eval's delta (llama-server - llmq) with its 95%
interval.

    python benchmarks/agent_tasks_vs_llamaserver.py --llama-cpp BUILD/bin --gguf FILE_OR_ARTIFACT --llmq REF
        [--limit 8] [--tasks tools,json,chat] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve_vs_llamacpp import LLMQ, gguf_path, server  # noqa: E402

from llmq.bench.llamacpp import LlamaCppNotFound, locate  # noqa: E402
from llmq.errors import LlmqError  # noqa: E402


def report(cmd: list[str], timeout: float) -> dict:
    """`llmq eval ... --json`'s report."""
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise LlmqError(f"llmq eval failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree or build/bin (or $LLAMA_CPP_DIR)")
    ap.add_argument("--gguf", required=True, help="GGUF file, or an llmq engine artifact of --target gguf")
    ap.add_argument("--llmq", required=True, help="the artifact llmq evaluates in process (the same weights)")
    ap.add_argument("--store", default=os.environ.get("LLMQ_STORE"))
    ap.add_argument("--tasks", default="tools,json,chat")
    ap.add_argument("--limit", type=int, default=8, help="items per task (per BFCL category for tools)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server's context (the longest prompt and answer)")
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--timeout", type=float, default=7200.0,
                    help="seconds the eval, and each answer, may take (eval's requests queue at llama-server's one "
                         "slot)")
    ap.add_argument("--work-dir", default="/tmp/agent-tasks-vs-llamaserver", help="the server's log")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args()
    try:
        lcpp = locate(a.llama_cpp)
    except LlamaCppNotFound as e:
        sys.exit(f"error: {e}")
    gguf, _ = gguf_path(a.gguf, a.store)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    store = ["--store", a.store] if a.store else []
    url = f"http://127.0.0.1:{a.port}"
    print(f"llama-server --jinja on {gguf}; baseline: llmq in process on {a.llmq}; --tasks {a.tasks} "
          f"--limit {a.limit}", flush=True)
    cmd = [lcpp.tool("llama-server"), "-m", gguf, "--jinja", "-t", str(a.threads), "-tb", str(a.threads), "-np", "1",
           "-c", str(a.ctx), "--host", "127.0.0.1", "--port", str(a.port), "--no-webui"]
    with server(cmd, url, work / "llama-server.log"):
        rep = report([*LLMQ, *store, "eval", "--endpoint", url, "--baseline", a.llmq, "--tasks", a.tasks,
                      "--limit", str(a.limit), "--timeout", str(a.timeout)], a.timeout)
    theirs = {**rep["scores"]["groups"], **rep["scores"]["tasks"]}
    ours = {**rep["baseline_scores"]["groups"], **rep["baseline_scores"]["tasks"]}
    print("\n| score | llmq | llama-server | llama-server - llmq (95% CI) |\n|---|---|---|---|")
    for name, d in rep["deltas"].items():
        lo, hi = d["ci95"]
        print(f"| {name} | {ours[name]['value']:.1f} | {theirs[name]['value']:.1f} | {d['delta']:+.1f} "
              f"({lo:+.1f}..{hi:+.1f}) |")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "gguf": gguf, "report": rep}, indent=1,
                                           default=str))

if __name__ == "__main__":
    main()
