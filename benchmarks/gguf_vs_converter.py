"""llmq's GGUF export against llama.cpp's own converter, tensor by tensor, on tiny random models of each family.

For each family: the test suite's tiny configuration (tests/helpers.py FAMILIES, with --tokenizer's vocabulary: the
converter refuses tokenizers it does not know, such as the tests' byte tokenizer), saved in bf16, imported and built
with `--target gguf`; the same directory converted by `convert_hf_to_gguf.py --outtype auto` (the tokenizer read as
stored: AS_STORED); then every tensor's name, GGML type, shape and dequantized values compared, and every metadata
key but the tokenizer's and the names.

    python benchmarks/gguf_vs_converter.py --llama-cpp SRC --tokenizer DIR [--converter-pythonpath DIR]
        [--families qwen3_5_text smollm3 ...]

SRC is a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp): its convert_hf_to_gguf.py runs with
its own gguf-py. Prints one line per family and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# where a family's test configuration is more than llama.cpp's graph takes (qwen35: one DeltaNet head width, heads
# of at least its M-RoPE sections; qwen3moe renormalizes the chosen experts; llama.cpp's
# phi3 has no sliding window); gemma3's query scale as its releases have it (the converter does not move another
# into the q norm, which llmq does)
GGUF_OVERRIDES = {"qwen3_5_text": dict(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32),
                  "qwen3_5_moe_text": dict(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32),
                  "qwen3_moe": dict(norm_topk_prob=True), "phi3": dict(sliding_window=None),
                  "gemma3_text": dict(query_pre_attn_scalar=24),
                  "gpt_oss": dict(swiglu_limit=7.0)}   # llama.cpp fixes gpt-oss's clamp at 7
NAMES = ("general.name", "general.size_label", "general.type", "general.file_type")
# The converter run with the borrowed tokenizer read as stored: transformers 5 otherwise swaps in its own tokenizer
# class for some model types (Qwen3.5-MoE's Qwen3_5Tokenizer re-pre-tokenizes), and the converter, which recognizes
# a tokenizer by the ids it gives a test text, would not know it
AS_STORED = ("import os, runpy, sys; import transformers.models.auto.tokenization_auto as t; "
             "t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.clear(); sys.argv = sys.argv[1:]; "
             "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")


def compare(ours: Path, theirs: Path, gguf) -> tuple[list[str], list[str]]:
    """(differences, keys only one file writes), one line each."""
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    out = [f"only llmq: {n}" for n in sorted(set(ta) - set(tb))] + \
          [f"only converter: {n}" for n in sorted(set(tb) - set(ta))]
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        dx, dy = (gguf.quants.dequantize(t.data, t.tensor_type) for t in (x, y))
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            out.append(f"{n}: {x.tensor_type.name} {list(x.shape)} vs {y.tensor_type.name} {list(y.shape)}")
        elif not np.array_equal(dx, dy):
            out.append(f"{n}: values differ by up to {np.abs(dx.astype(np.float64) - dy).max():.3g}")
    fa, fb = ({k: f.contents() for k, f in r.fields.items() if not k.startswith(("tokenizer.", "GGUF."))
               and k not in NAMES} for r in (a, b))
    out += [f"key {k}: {fa[k]!r} vs {fb[k]!r}" for k in sorted(set(fa) & set(fb)) if fa[k] != fb[k]]
    alone = [f"key {k} only in {'llmq' if k in fa else 'converter'}'s: {fa.get(k, fb.get(k))!r}"
             for k in sorted(set(fa) ^ set(fb))]
    return out, alone


def main() -> None:
    from helpers import FAMILIES, family_model
    from test_export_gguf import _bf16
    from transformers import AutoTokenizer

    from llmq.artifacts import Store
    from llmq.errors import LlmqError
    from llmq.models import resolve_model
    from llmq.models.arch import ARCHS
    from llmq.pipeline.targets import BuildOptions, build_engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer directory the converter knows")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--converter-pythonpath", action="append", default=[],
                    help="a directory of what the converter imports beyond this environment (e.g. sentencepiece)")
    args = ap.parse_args()
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise SystemExit(f"{converter} not found: give --llama-cpp a llama.cpp source tree")
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))   # the converter's gguf-py, to read its newest types
    import gguf

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.llama_cpp / "gguf-py"), *args.converter_pythonpath]))
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        for family in args.families:
            hf = Path(tmp) / family
            import helpers
            helpers.FAMILIES = {**FAMILIES, family: {**FAMILIES[family], **GGUF_OVERRIDES.get(family, {}),
                                                     "vocab_size": len(tok)}}
            family_model(hf, family)
            tok.save_pretrained(hf)
            _bf16(hf, random_norms=True)
            try:
                engine = build_engine(resolve_model(str(hf), store), store, BuildOptions(target="gguf"))
            except LlmqError as e:
                print(f"{family:14s} refused by llmq: {e}")
                continue
            ours = next(engine.path.glob("*.gguf"))
            theirs = Path(tmp) / f"{family}.converter.gguf"
            # the converter's Qwen3-Next-derived classes ask whether to write a multi-token-prediction head
            mtp = ["--no-mtp"] if ARCHS[family].linear_attention is not None else []
            p = subprocess.run([sys.executable, "-c", AS_STORED, str(converter), str(hf), "--outtype", "auto", *mtp,
                                "--outfile", str(theirs)], env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{family:14s} the converter failed: {p.stderr.strip().splitlines()[-1][:200]}")
                continue
            diffs, alone = compare(ours, theirs, gguf)
            failed |= bool(diffs)
            n = len(gguf.GGUFReader(ours).tensors)
            print(f"{family:14s} {'identical' if not diffs else 'DIFFERS'}: {n} tensors ({ours.name})")
            for d in diffs[:20] + alone:
                print(f"    {d}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
