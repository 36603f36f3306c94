"""Output throughput of the llmq runtime vs Hugging Face `generate` run sequentially, plus batch-1 decode speed.

One run on the default model (SmolLM2-135M-Instruct) by default:
1. HF transformers `generate` (float32, the fast dtype on CPU; greedy) over the prompts one after another:
   output tokens / wall time. Sequential throughput does not depend on how many prompts are run, so only
   --hf-prompts of them are timed.
2. The runtime at concurrency 1, 8 and 32: that many requests in flight, closed loop, --waves x concurrency requests
   in all (128-token prompts, 128 output tokens each, ignore_eos), driven in-process through LLMEngine.step()
   (the engine that `llmq serve` runs), or with --serve
   through a `llmq serve` subprocess over HTTP (--url: an already running server); output tokens / wall time, and
   the ratio to (1). Target: >= 10x at concurrency 32.
3. Batch-1 decode tokens/s and MBU for the bf16 model and its INT8 / INT4 weight-only quantizations (when the
   quantize stage is available): steady-state decode steps of one sequence after a 128-token prefill.
   MBU = bytes read per step (weights + KV cache) / step time / peak read bandwidth, where the peak is measured
   here by summing a 1 GiB buffer. Target: INT4 faster than INT8 faster than bf16.

    python benchmarks/bench_serve_throughput.py [--model REF] [--store DIR] [--concurrency 1 8 32] [--serve]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.artifacts import Store  # noqa: E402
from llmq.bench.hw import read_bandwidth  # noqa: E402
from llmq.bench.llamacpp import stop  # noqa: E402
from llmq.models import resolve_model  # noqa: E402
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def hf_sequential(model_dir: Path, prompts: list[list[int]], max_new: int, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, cache_implementation: str | None = None) -> dict:
    """transformers `generate`, greedy, one prompt after another. cache_implementation="static" makes generate
    compile its decoding step (torch.compile), the fastest plain-transformers setup on a GPU; then the first two
    prompts are run once untimed first (compilation, autotuning)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
              **({"cache_implementation": cache_implementation} if cache_implementation else {}))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    with torch.no_grad():
        for p in prompts[:2] if cache_implementation else []:  # warm-up: compile for the shapes timed below
            model.generate(torch.tensor([p], device=device), **kw)
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4, do_sample=False)
        sync()
        t = time.perf_counter()
        tokens = 0
        for p in prompts:
            out = model.generate(torch.tensor([p], device=device), **kw)
            tokens += out.shape[1] - len(p)
        sync()
        dt = time.perf_counter() - t
    del model
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def runtime_concurrency(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_new: int) -> dict:
    """Keep `concurrency` requests in flight until every prompt is done (closed loop)."""
    sp = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    queue = list(enumerate(prompts))
    in_flight, tokens, ttft = 0, 0, []
    t = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and in_flight < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"c{concurrency}-{i}", p, sp)
            in_flight += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    dt = time.perf_counter() - t
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "seconds": dt,
            "tokens_per_s": tokens / dt, "mean_ttft_s": sum(ttft) / len(ttft),
            "preemptions": engine.stats().num_preemptions}


def server_concurrency(url: str, model: str | None, prompts: list[list[int]], concurrency: int, max_new: int,
                       stream: bool = False) -> dict:
    """The same closed loop against an OpenAI-compatible /v1/completions endpoint (e.g. `llmq serve`), one thread
    per in-flight request; streamed (SSE) or not."""
    import threading

    import httpx

    queue = list(prompts)
    lock = threading.Lock()
    tokens, latency = [0], []

    def worker():
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    p = queue.pop(0)
                body = {"prompt": p, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "stream": stream,
                        **({"stream_options": {"include_usage": True}} if stream else {}),
                        **({"model": model} if model else {})}
                t = time.perf_counter()
                if stream:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
                    n = json.loads(last[6:])["usage"]["completion_tokens"]
                else:
                    r = client.post("/v1/completions", json=body)
                    r.raise_for_status()
                    n = r.json()["usage"]["completion_tokens"]
                with lock:
                    tokens[0] += n
                    latency.append(time.perf_counter() - t)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens[0], "seconds": dt,
            "tokens_per_s": tokens[0] / dt, "mean_latency_s": sum(latency) / len(latency)}


def start_server(model_path: Path, port: int):
    """`llmq serve` in a subprocess, ready when /health answers."""
    import subprocess

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "llmq", "serve", str(model_path), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"llmq serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("llmq serve did not become healthy in 300 s")


def batch1_decode(path: Path, prompt: list[int], steps: int, peak_bw: float, config: EngineConfig | None = None
                  ) -> dict:
    engine = LLMEngine(path, config or EngineConfig(max_num_seqs=1))
    engine.add_request("d", prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while engine.requests["d"].num_computed_tokens < len(prompt):
        engine.step()
    for _ in range(3):
        engine.step()
    seq, model = engine.requests["d"], engine.runner.model
    ctx0, experts0 = seq.num_computed_tokens, model.expert_bytes_read()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t) / steps
    ctx = (ctx0 + seq.num_computed_tokens) / 2
    spec = engine.spec
    kv_elem = 1 if engine.kv_cache_dtype in ("int8", "fp8") else engine.runner.dtype.itemsize
    kv_bytes = spec.kv_bytes_per_token(kv_elem) * ctx
    expert_bytes = (model.expert_bytes_read() - experts0) / steps   # the routed experts a step read (MoE)
    weight_bytes = model.weight_bytes() + expert_bytes
    engine.shutdown()
    return {"tokens_per_s": 1 / dt, "step_ms": dt * 1e3, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "expert_bytes": expert_bytes, "mbu": (weight_bytes + kv_bytes) / dt / peak_bw}


def quantized_variants(source, store: Store) -> dict[str, Path]:
    """INT8 (per channel) and INT4 (groups of 64) RTN weight-only artifacts of the model, made by the quantize stage."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    return {"int8": quantize(source, QuantizeOptions(bits=8, group_size=0), store).path,
            "int4": quantize(source, QuantizeOptions(bits=4, group_size=64), store).path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model reference (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-prompts", type=int, default=3, help="prompts timed for the sequential HF baseline")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests per concurrency level = waves x concurrency (closed loop: a finished request is "
                         "replaced at once, so ramp-up and drain weigh less with more waves)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--skip-quantized", action="store_true")
    ap.add_argument("--serve", action="store_true",
                    help="measure concurrency through `llmq serve` over HTTP instead of the in-process engine")
    ap.add_argument("--url", default=None, help="measure concurrency against this running OpenAI-compatible server")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    store = Store.open(args.store)
    model = resolve_model(args.model, store)
    engine = LLMEngine(model.path, EngineConfig(max_num_seqs=max(args.concurrency)))
    vocab = engine.spec.vocab_size
    n_max = max(args.concurrency) * args.waves
    prompts = make_prompts(max(n_max, args.hf_prompts), args.prompt_len, vocab)
    print(f"model {model.name}/v{model.version}  threads {torch.get_num_threads()}  "
          f"prompt {args.prompt_len}  output {args.output_len}")

    hf = hf_sequential(model.path, prompts[:args.hf_prompts], args.output_len)
    print(f"HF generate, sequential ({hf['requests']} requests): {hf['tokens_per_s']:.1f} output tok/s")
    results = {"hf_sequential": hf, "runtime": [], "decode_batch1": {}}
    server, url = None, args.url
    if args.serve or url:
        engine.shutdown()
        if args.serve:
            server, url = start_server(model.path, args.port)
        print(f"runtime measured through HTTP at {url}")
    else:
        print("runtime measured in-process (LLMEngine.step(), the engine `llmq serve` runs)")
    print(f"{'concurrency':>11} {'requests':>8} {'out tok/s':>10} {'vs HF':>7} {'mean TTFT/lat':>13}")
    try:
        for c in args.concurrency:
            if url:
                import httpx

                served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                r = server_concurrency(url, served, prompts[:c * args.waves], c, args.output_len)
                lat = r["mean_latency_s"]
            else:
                r = runtime_concurrency(engine, prompts[:c * args.waves], c, args.output_len)
                lat = r["mean_ttft_s"]
            r["ratio_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
            results["runtime"].append(r)
            print(f"{c:>11} {r['requests']:>8} {r['tokens_per_s']:>10.1f} {r['ratio_vs_hf']:>6.1f}x {lat:>12.2f}s")
    finally:
        if server is not None:
            stop(server, 60)
    engine.shutdown()

    peak = read_bandwidth("cpu", 1 << 30)  # llmq bench hw's measurement, over a 1 GiB buffer, now
    results["peak_read_bandwidth_gbs"] = peak / 1e9
    variants = {"bf16": model.path}
    if not args.skip_quantized:
        variants.update(quantized_variants(model, store))
    print(f"batch-1 decode (peak read bandwidth measured {peak / 1e9:.1f} GB/s)")
    print(f"{'weights':>8} {'tok/s':>7} {'step ms':>8} {'MB/step':>8} {'MBU':>6}")
    for name, path in variants.items():
        d = batch1_decode(path, prompts[0], args.decode_steps, peak)
        results["decode_batch1"][name] = d
        print(f"{name:>8} {d['tokens_per_s']:>7.1f} {d['step_ms']:>8.1f} "
              f"{(d['weight_bytes'] + d['kv_bytes']) / 1e6:>8.1f} {d['mbu']:>6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
