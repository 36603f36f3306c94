"""What the HTTP layer costs: output throughput of the same engine driven in-process vs through `llmq serve`'s app.

One run, same engine configuration and prompts: (1) a closed loop of `concurrency` requests on LLMEngine.step()
directly, (2) the same closed loop as OpenAI /v1/completions requests (non-streaming and streaming) to the server
app (uvicorn in a thread of this process, engine loop thread inside), then (1) again. Prints output tokens/s and
the ratio to the mean of the in-process runs.

    python benchmarks/bench_server_overhead.py [--model REF] [--store DIR] [--concurrency 8] [--requests 16]
        [--prompt-len 64] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# this script's folder is on sys.path
from bench_serve_throughput import runtime_concurrency, server_concurrency  # noqa: E402

from llmq.artifacts import Store  # noqa: E402
from llmq.models import resolve_model  # noqa: E402
from llmq.runtime import EngineConfig, LLMEngine  # noqa: E402
from llmq.runtime.server import EngineThread, create_app  # noqa: E402


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--store", default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()

    model = resolve_model(args.model, Store.open(args.store))
    # the engine is built and driven on one EngineThread, as `llmq serve` does (engine_loop.py says why)
    engine_thread = EngineThread()
    engine = engine_thread.call(LLMEngine, model.path,
                                EngineConfig(max_num_seqs=args.concurrency, kv_cache_memory=256 << 20))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, engine.spec.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]

    def in_process() -> float:
        return engine_thread.call(runtime_concurrency, engine, prompts, args.concurrency,
                                  args.output_len)["tokens_per_s"]

    def over_http(url: str, stream: bool) -> float:
        return server_concurrency(url, None, prompts, args.concurrency, args.output_len, stream)["tokens_per_s"]

    # bracketed (engine, HTTP, HTTP-SSE, engine again): on a shared machine the spread of the two engine runs shows
    # how much of any difference is noise. The engine is driven directly only while no server (whose engine loop
    # then owns it) is up.
    in_process()  # warm-up; fills the prefix cache
    before = in_process()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, thread=engine_thread), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        plain = over_http(url, stream=False)
        streamed = over_http(url, stream=True)
    finally:
        server.should_exit = True
        thread.join(60)
    try:
        after = in_process()
    finally:
        engine_thread.call(engine.shutdown)
        engine_thread.close()
    print(f"model {model.name}/v{model.version}  concurrency {args.concurrency}  requests {args.requests}  "
          f"prompt {args.prompt_len}  output {args.output_len}")
    print(f"{'path':<22} {'out tok/s':>10} {'vs engine':>9}")
    base = (before + after) / 2
    rows = (("engine in-process (1)", before), ("HTTP non-streaming", plain), ("HTTP streaming (SSE)", streamed),
            ("engine in-process (2)", after))
    for name, v in rows:
        print(f"{name:<22} {v:>10.1f} {v / base:>8.2f}x")
    print("ratios are to the mean of the two in-process runs")


if __name__ == "__main__":
    main()
