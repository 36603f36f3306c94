"""A Qwen3.5-shaped hybrid at 0.6B parameters served by `llmq serve` and by llama-server (its `qwen35`), side by side.

Not part of CI (the checkpoint is 1.2 GB and llama.cpp is built outside the project, docs/bench.md). The checkpoint
has random bf16 weights in Qwen3.5's layer pattern (three Gated DeltaNet layers to one gated attention layer) at
0.6B parameters: hidden 1024, 24 layers, MLP 3584, attention 8 heads / 2 KV heads of 256 with RoPE over a quarter,
DeltaNet 16 key / 16 value heads of 128 (one width: llama.cpp's graph needs it), SmolLM2's vocabulary and tokenizer
(bench_moe_real_width.make_checkpoint). It is quantized INT4 (RTN, groups of 32) and that artifact is both what llmq
serves and what `llmq build --target gguf` writes as Q4_0 for llama-server: the same integers on both sides. Then
bench_serve_vs_llamacpp.py runs both servers on the same cores, one level at a time (--concurrency: 1 is batch-1
decode, its TTFT the prefill of --input-len tokens).

    python benchmarks/bench_hybrid_vs_llamacpp.py --work /tmp/hybrid --llama-cpp DIR [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
             max_position_embeddings=8192, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
LLMQ = [sys.executable, "-m", "llmq"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="directory for the checkpoint and the store")
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree or build/bin")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    store, model = a.work / "store", a.work / f"qwen35-hybrid-{a.layers}layers"
    art, gguf = f"{model.name}-rtn-w4g32", f"{model.name}-rtn-w4g32-gguf"
    if not model.is_dir():
        from bench_moe_real_width import make_checkpoint

        from llmq.artifacts import Store
        from llmq.models import resolve_model

        make_checkpoint(model, SHAPE, a.layers, resolve_model(None, Store.open(store)).path)
    base = [*LLMQ, "--store", str(store)]
    if not (store / art).is_dir():
        subprocess.run([*base, "quantize", str(model), "--method", "rtn", "--bits", "4", "--group-size", "32",
                        "--probe-tokens", "0", "--name", art], check=True)
    if not (store / gguf).is_dir():
        subprocess.run([*base, "build", art, "--target", "gguf", "--name", gguf], check=True)
    cmd = [sys.executable, str(Path(__file__).with_name("bench_serve_vs_llamacpp.py")), "--llama-cpp", a.llama_cpp,
           "--gguf", gguf, "--llmq", art, "--store", str(store), "--threads", str(a.threads), "--input-len",
           str(a.input_len), "--output-len", str(a.output_len), "--rounds", str(a.rounds), "--concurrency",
           *map(str, a.concurrency), *(["--json", a.json] if a.json else [])]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
