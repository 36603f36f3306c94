"""An llmq GGUF export run by llama.cpp itself, against llmq's runtime on the artifact it was written from.

`llmq build REF --target gguf` (reused from the store when already built), then, on the held-out prose of llmq's
`ppl` eval task (or --text):
- distributions: `llama-perplexity -c N --kl-divergence-base` stores llama.cpp's log-probs of every scored position
  (chunks of N tokens, BOS first, the second half scored); llmq's LLMEngine.prompt_logprobs over the same chunks gives
  the mean KLD(llama.cpp || llmq) (llama.cpp's own formula), top-1 agreement and both perplexities;
- tokenizer: llama-server's /tokenize against llmq's tokenizer on the text, each of its lines and strings with runs of
  spaces, tabs, newlines, digits, non-ASCII and markup;
- generation: llama-server's greedy /completion against llmq's greedy continuation of the same prompts.

    python benchmarks/gguf_in_llamacpp.py --llama-cpp /tmp/lcp/.../llama.cpp/build/bin REF [--store DIR] [--ctx 256]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HELDOUT = Path(__file__).resolve().parents[1] / "llmq" / "evals" / "tasks" / "data" / "heldout_en.txt"
STRINGS = ["  two  spaces   three", "tabs\tand\t\ttabs\n\n\nnewlines", "ünïcødé ☃ 日本語 🙂", "<h1>Title</h1> </s> x",
           "def f(x):\n    return x**2  # 12345", "1234567890 3.14159", " leading space", "trailing space ", "\n"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):\n",
           "The three primary colours are", "Water boils at a temperature of", "My favourite book is",
           "In 1969, the first humans", "The quick brown fox", "To make a cup of tea, first",
           "The harbour town wakes before the sun does."]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))


def distributions(bin_dir: Path, gguf: Path, art: Path, text: Path, ctx: int, threads: int) -> dict:
    import torch

    from llmq.bench.llamacpp import KldBase, chunks, kld_vs_base, run, scored
    from llmq.runtime import EngineConfig, LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        out = run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                   "-t", str(threads), "--kl-divergence-base", f"{tmp}/base.kld"], "llama-perplexity")
        base = KldBase(f"{tmp}/base.kld")
        sl = scored(ctx)
        engine = LLMEngine(art, EngineConfig(max_num_seqs=1, max_model_len=ctx, max_num_batched_tokens=ctx))
        try:
            tok = engine.tokenizer
            ids = tok.encode(text.read_text(encoding="utf-8"), add_special_tokens=False)
            add_bos = base.add_bos(ids, tok.bos_token_id)   # raises unless llama.cpp's tokens are llmq's
            kl, top, nll = [], [], []
            for i, c in enumerate(chunks(ids, ctx, add_bos, tok.bos_token_id)):
                lp = engine.prompt_logprobs(c)[sl].double()
                nll += (-lp.gather(1, torch.tensor(c[sl.start + 1:])[:, None])[:, 0]).tolist()
                a, t = kld_vs_base(base.logprobs(i), lp)
                kl += a.tolist()
                top += t.float().tolist()
        finally:
            engine.shutdown()
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)   # the base file clips log-probs
    return {"ctx": ctx, "chunks": base.n_chunk, "scored": len(kl), "add_bos": add_bos,
            "kld_mean": sum(kl) / len(kl), "kld_max": max(kl), "top1": sum(top) / len(top),
            "ppl_llama_cpp": float(final[1]), "ppl_llama_cpp_stderr": float(final[2]),
            "ppl_llmq": math.exp(sum(nll) / len(nll))}


def server_checks(bin_dir: Path, gguf: Path, art: Path, text: Path, threads: int, port: int, n: int) -> dict:
    import torch

    from llmq.bench.llamacpp import stop
    from llmq.runtime import EngineConfig, LLMEngine, SamplingParams

    server = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-c", "1024",
                               "-np", "1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    engine = None
    try:
        for _ in range(600):
            try:
                if json.load(urllib.request.urlopen(url + "/health", timeout=5)).get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        engine = LLMEngine(art, EngineConfig(max_model_len=256))
        tok = engine.tokenizer
        body = text.read_text(encoding="utf-8")
        cases = [body, *body.splitlines(), *STRINGS]
        differ = [s[:40] for s in cases
                  if _post(url + "/tokenize", {"content": s, "add_special": True})["tokens"] != tok(s).input_ids]
        same = agree = total = 0
        gap = 0.0   # at a disagreement: llmq's log-prob of its own top-1 minus that of llama.cpp's token
        for p in PROMPTS:
            cpp = [t["id"] for t in _post(url + "/completion", {"prompt": p, "n_predict": n, "temperature": 0,
                                                                 "n_probs": 1, "cache_prompt": False})[
                "completion_probabilities"]]
            ids = tok(p).input_ids
            mine = engine.generate([ids], SamplingParams(max_tokens=len(cpp), temperature=0.0))[0].output_token_ids
            lp = engine.prompt_logprobs(ids + cpp)
            rows = lp[len(ids) - 1:len(ids) - 1 + len(cpp)].double()
            hit = rows.argmax(-1) == torch.tensor(cpp)
            agree += int(hit.sum())
            gap = max([gap] + (rows.max(-1).values - rows[torch.arange(len(cpp)), cpp])[~hit].tolist())
            total += len(cpp)
            same += mine == cpp
    finally:
        if engine is not None:
            engine.shutdown()
        stop(server)
    return {"tokenize_identical": f"{len(cases) - len(differ)}/{len(cases)}", "tokenize_differ": differ,
            "greedy_identical": f"{same}/{len(PROMPTS)} ({n} tokens each)",
            "teacher_forced_top1": f"{agree}/{total}", "max_logprob_gap_where_top1_differs": gap}


def main() -> int:
    from llmq.artifacts.store import Store, default_store_path
    from llmq.models.resolve import source_artifact
    from llmq.pipeline.targets import BuildOptions, build_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", help="llmq model or quantized artifact (or any model reference)")
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp's build/bin (llama-perplexity, llama-server)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--text", default=str(HELDOUT))
    ap.add_argument("--ctx", type=int, default=256, help="llama-perplexity -c")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--tokens", type=int, default=32, help="greedy continuation length")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    store = Store(args.store or default_store_path())
    src = source_artifact(args.ref, store)
    engine = build_engine(src, store, BuildOptions(target="gguf"))
    gguf = engine.path / json.loads((engine.path / "engine.json").read_text())["outputs"]["gguf"]["file"]
    bin_dir, text = Path(args.llama_cpp), Path(args.text)
    result = {"source": src.ref, "gguf": str(gguf),
              "distributions": distributions(bin_dir, gguf, src.path, text, args.ctx, args.threads),
              "server": server_checks(bin_dir, gguf, src.path, text, args.threads, args.port, args.tokens)}
    print(json.dumps(result, indent=2, ensure_ascii=False))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
