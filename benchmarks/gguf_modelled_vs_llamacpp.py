"""The KLD `llmq build --target gguf` records for llama.cpp (modelled) against what llama.cpp itself measures.

For every held-out text: llama-perplexity -c N -t T --kl-divergence-base of llama.cpp's F16 GGUF (cached in --work-dir
by the text's digest). For every artifact LABEL=REF: its GGUF export (`llmq build --target gguf`, reused from the store
when built), then on the base file's own tokens (llama.cpp's tokenization, so the two engines score the same
predictions whatever llmq's tokenizer makes of the text; the second half of each chunk, as llama-perplexity scores):
- llama.cpp: `llama-perplexity --kl-divergence` of the export (its mean KLD and "Same top p");
- modelled: the file as llama.cpp's CPU arithmetic computes it (pipeline/targets/gguf_compute: decoded blocks,
  activations rounded per vec_dot_type), against the same base file with llama.cpp's formula (kld_vs_base);
- llmq: the artifact in llmq's runtime (float32), the same way.
Prints each KLD and its ratio to llama.cpp's.

    python benchmarks/gguf_modelled_vs_llamacpp.py --llama-cpp .../llama.cpp/build/bin --f16 model-F16.gguf \\
        --text python=copy.py,abc.py,contextlib.py --text prose=/usr/share/common-licenses/GPL-3 int8=REF ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bench.llamacpp import KldBase, gguf_bos, kld_vs_base, locate, parse_kld_output, run, scored  # noqa: E402
from llmq.errors import LlmqError  # noqa: E402


def text_file(files: str, work: Path) -> Path:
    """The comma-separated files (stdlib names or paths) joined as the benchmark joins them, written to `work`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((Path(f) if Path(f).is_absolute() else root / f).read_text(encoding="utf-8")
                       for f in files.split(","))
    out = work / f"text-{hashlib.sha256(text.encode()).hexdigest()[:16]}.txt"
    out.write_text(text, encoding="utf-8")
    return out


def base_file(ppl: list[str], f16: Path, text: Path, chunks: int) -> Path:
    """F16's log-probs of the text's first `chunks` chunks (llama-perplexity --chunks), cached beside the text."""
    out = text.with_name(f"{text.stem}-{ppl[ppl.index('-c') + 1]}x{chunks}.kld")
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        run(ppl + ["--chunks", str(chunks), "-m", str(f16), "-f", str(text), "--kl-divergence-base", str(tmp)],
            "llama-perplexity (base)")
        tmp.replace(out)
    return out


def llmq_side(src_path: Path, base: KldBase, chunks: list[list[int]], modelled: bool, batch: int) -> dict:
    """Mean KLD / top-1 against the base file of the artifact in llmq's runtime, or of its file as llama.cpp computes
    it (modelled)."""
    import torch

    from llmq.evals.compare import mean_stderr
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.targets.gguf_compute import GgmlLinear, file_rank
    from llmq.runtime.model_runner import rank_weights, score_in_process

    src = CheckpointReader(src_path)
    s, sl = src.spec, scored(base.n_ctx)
    rw = file_rank(src) if modelled else rank_weights(src, None, 0)
    kl, top = [], []
    for i in range(0, len(chunks), batch):
        with torch.no_grad():
            logits = score_in_process([rw], src.config, s.num_heads, s.num_kv_heads,
                                      torch.tensor(chunks[i:i + batch]), linear_module=GgmlLinear if modelled else None)
        for j in range(logits.shape[0]):
            a, b = kld_vs_base(base.logprobs(i + j), torch.log_softmax(logits[j, sl].double(), -1))
            kl += a.tolist()
            top += b.double().tolist()
    (m, se), (t1, _) = mean_stderr(kl), mean_stderr(top)
    return {"kld": m, "kld_stderr": se, "top1": 100 * t1, "tokens": len(kl)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree or its build/bin")
    ap.add_argument("--f16", required=True, type=Path, help="llama.cpp's F16 GGUF of the source model (the base)")
    ap.add_argument("--text", action="append", required=True, metavar="NAME=FILES",
                    help="held-out text: comma-separated stdlib names or paths; repeatable")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llmq-gguf-modelled"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=16, help="chunks scored per text (each must have that many)")
    ap.add_argument("--batch", type=int, default=4, help="chunks per llmq forward")
    ap.add_argument("--json", default=None)
    ap.add_argument("artifacts", nargs="+", metavar="LABEL=REF")
    args = ap.parse_args()
    from llmq.artifacts import Store
    from llmq.pipeline.targets import BuildOptions, build_engine

    lc = locate(args.llama_cpp, ())
    ppl = [lc.tool("llama-perplexity"), "-c", str(args.ctx), "-t", str(args.threads)]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    add_bos, bos = gguf_bos(args.f16)
    texts = {}
    for spec in args.text:
        name, files = spec.split("=", 1)
        tf = text_file(files, args.work_dir)
        kb = KldBase(base_file(ppl, args.f16, tf, args.chunks))
        if kb.n_chunk < args.chunks:
            raise LlmqError(f"text {name}: {kb.n_chunk} chunks of {args.ctx} tokens, fewer than {args.chunks}")
        texts[name] = (tf, kb, kb.chunk_tokens(add_bos, bos), files)
    store = Store.open(args.store)
    rows = []
    for spec in args.artifacts:
        label, ref = spec.split("=", 1)
        art = store.resolve(ref)
        eng = build_engine(art, store, BuildOptions(target="gguf", probe_tokens=0, name=f"{art.name}-gguf-check"))
        gguf = eng.path / json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]["file"]
        for name, (tf, kb, chunks, files) in texts.items():
            cpp = parse_kld_output(run(ppl + ["--kl-divergence-base", str(kb.path), "-m", str(gguf),
                                              "--kl-divergence"], f"llama-perplexity --kl-divergence ({label})"))
            row = {"label": label, "ref": art.ref, "text": name, "files": files, "chunks": kb.n_chunk,
                   "gguf_bytes": gguf.stat().st_size, "llama_cpp": cpp,
                   "modelled": llmq_side(art.path, kb, chunks, True, args.batch),
                   "llmq_runtime": llmq_side(art.path, kb, chunks, False, args.batch)}
            rows.append(row)
            c, m, r = cpp["kld"], row["modelled"]["kld"], row["llmq_runtime"]["kld"]
            print(f"{label:<12} {name:<7} {kb.n_chunk:>3} chunks  llama.cpp {c:.5f} ± {cpp['kld_stderr']:.5f} "
                  f"(top-1 {cpp['top1']:.2f} %)  modelled {m:.5f} ({m / c:.3f}x, top-1 {row['modelled']['top1']:.2f}"
                  f" %)  llmq runtime {r:.5f} ({r / c:.3f}x, top-1 {row['llmq_runtime']['top1']:.2f} %)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
