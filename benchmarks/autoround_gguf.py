"""AutoRound's own GGUF of an llmq model, calibrated on the very windows `llmq quantize` takes: the peer file that
bench_vs_llamacpp.py scores beside llama.cpp's and llmq's (`--gguf LABEL=FILE`, issue 53 item 4).

AutoRound (Intel's `auto-round` package) is not a dependency of llmq; install it beside, without touching the
environment's torch / transformers:

    pip install --no-deps --target /tmp/ardeps auto-round py-cpuinfo
    PYTHONPATH=/tmp/ardeps python benchmarks/autoround_gguf.py --format q4_k_m --iters 0 --out /tmp/ar-q4km-rtn.gguf
    PYTHONPATH=/tmp/ardeps python benchmarks/autoround_gguf.py --format q4_k_m --iters 50 --out /tmp/ar-q4km-50.gguf

--iters 0 is AutoRound's round-to-nearest (its own k-quant scale search, no tuning); a positive count tunes each
block that many signed-gradient steps on the calibration windows (its default 200). The windows are llmq's default
calibration (bundled prose, chat and code; --num-samples x --seq-len tokens, --seed): the same tokens the llmq
variants and their importance matrices come from, so the three tools see the same data. Prints the file's bytes and
the wall time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.errors import LlmqError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="llmq model reference (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--format", default="q4_k_m", help="AutoRound's GGUF format after `gguf:` (q4_k_m, q5_k_m, ...)")
    ap.add_argument("--iters", type=int, default=0, help="tuning steps per block (0: its round-to-nearest)")
    ap.add_argument("--num-samples", type=int, default=32, help="calibration windows (llmq quantize's default)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens a window (llmq quantize's default)")
    ap.add_argument("--seed", type=int, default=0, help="llmq's window choice (quantize --seed)")
    ap.add_argument("--out", required=True, help="where the GGUF goes")
    args = ap.parse_args()
    try:
        from auto_round import AutoRound
    except ImportError:
        print("needs the auto-round package: pip install --no-deps --target DIR auto-round py-cpuinfo, then "
              "PYTHONPATH=DIR", file=sys.stderr)
        return 2
    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_calibration

    try:
        model = resolve_model(args.model, Store.open(args.store))
        windows = load_calibration(None, load_tokenizer(model.path), args.num_samples, args.seq_len, args.seed)
    except LlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ar = AutoRound(str(model.path), scheme=f"gguf:{args.format}", iters=args.iters,
                       nsamples=len(windows.samples), seqlen=args.seq_len, seed=args.seed, device_map="cpu",
                       dataset=[w[None] for w in windows.samples])
        ar.quantize_and_save(tmp, format=f"gguf:{args.format}")
        files = sorted(Path(tmp).rglob("*.gguf"))
        if len(files) != 1:
            print(f"error: AutoRound wrote {len(files)} GGUF files: {[f.name for f in files]}", file=sys.stderr)
            return 1
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(files[0]), args.out)
    size = Path(args.out).stat().st_size
    print(f"{args.out}: {size:,} bytes, AutoRound gguf:{args.format} --iters {args.iters} on {len(windows.samples)} x "
          f"{args.seq_len} tokens of llmq's calibration ({windows.source}), {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
