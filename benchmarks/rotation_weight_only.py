"""What `llmq quantize --rotate hadamard` (issue 53, item 1) buys: each quantization made twice by the quantize stage,
plain and rotated, and scored the same way in one run.

For each --configs entry (method:bits:group, group 0 = per output channel; method rtn / gptq / awq / smoothquant)
the stage quantizes the model (--num-samples calibration windows where the method calibrates) with --rotate none and
hadamard. Each artifact is scored by llmq's runtime (what `llmq serve` runs) against the unrotated 16-bit model over
the first --tokens tokens of each held-out text of bench_vs_llamacpp.py (Python source, license prose), in chunks of
512 tokens: mean KLD (float64) and top-1 agreement, with the rotated / plain ratio. The stage's own probe (held-out
chat text, against the model it quantized: the rotated one for --rotate) is printed beside it.

    python benchmarks/rotation_weight_only.py [--model REF] [--configs rtn:4:32 gptq:4:64 ...] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_vs_llamacpp import TEXTS, heldout_text  # noqa: E402

from llmq.artifacts import Store  # noqa: E402
from llmq.models import resolve_model  # noqa: E402

CONFIGS = ("rtn:4:32", "rtn:4:64", "rtn:5:32", "gptq:4:64", "gptq:5:32", "rtn:4:0", "smoothquant:8:0")


def _logprobs(path: Path, chunks: list[list[int]]) -> list[torch.Tensor]:
    from llmq.runtime import EngineConfig, LLMEngine

    engine = LLMEngine(path, EngineConfig(kv_cache_memory=64 << 20, max_model_len=512, enable_prefix_caching=False))
    try:
        return [engine.prompt_logprobs(c).double() for c in chunks]
    finally:
        engine.shutdown()


def _score(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got)])
    top = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)])
    return float(kl.mean()), float(top.double().mean())


def main() -> None:
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model reference (default: the embedded default model)")
    p.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help="method:bits:group entries")
    p.add_argument("--tokens", type=int, default=2048, help="scored tokens per text")
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows of the calibrated methods")
    p.add_argument("--seed", type=int, default=0, help="the rotation's signs (and the calibration windows)")
    args = p.parse_args()
    store = Store.open(args.store)
    source = resolve_model(args.model, store)
    tok = load_tokenizer(source.path)
    texts = {name: tok(heldout_text(list(files))[0]).input_ids[:args.tokens] for name, files in TEXTS.items()}
    chunks = {name: [ids[i:i + 512] for i in range(0, len(ids), 512)] for name, ids in texts.items()}
    ref = {name: _logprobs(source.path, c) for name, c in chunks.items()}
    print(f"{source.name}: {torch.get_num_threads()} threads; KLD / top-1 against the 16-bit model over "
          + ", ".join(f"{len(ids)} tokens of {name}" for name, ids in texts.items()))
    for entry in args.configs:
        method, bits, group = entry.split(":")
        row = {}
        for rotate in ("none", "hadamard"):
            t0 = time.perf_counter()
            opts = QuantizeOptions(method=method, bits=int(bits), group_size=int(group), rotate=rotate,
                                   num_samples=args.num_samples, seed=args.seed)
            art = quantize(source, opts, store, progress=False)
            took = time.perf_counter() - t0
            scores = {name: _score(ref[name], _logprobs(art.path, c)) for name, c in chunks.items()}
            row[rotate] = (scores, art.metrics["probe"]["kld_mean"], took)
        for name in texts:
            (kp, tp), (kr, tr) = row["none"][0][name], row["hadamard"][0][name]
            print(f"  {entry:16s} {name:6s} KLD plain {kp:.4f} rotated {kr:.4f} (x{kr / kp:.2f})  top-1 {tp:.3f} / "
                  f"{tr:.3f}")
        print(f"  {entry:16s} probe  KLD plain {row['none'][1]:.4f} rotated {row['hadamard'][1]:.4f} "
              f"(x{row['hadamard'][1] / row['none'][1]:.2f}); quantize {row['none'][2]:.0f} s / "
              f"{row['hadamard'][2]:.0f} s")


if __name__ == "__main__":
    main()
