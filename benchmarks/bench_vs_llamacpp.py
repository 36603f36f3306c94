"""llmq vs llama.cpp on the same model and machine: batch-1 speed and quantization quality, in one run.

Needs a llama.cpp build (--llama-cpp DIR or $LLAMA_CPP_DIR: its source tree or build/bin; without one this prints how
to build it and exits 2). llmq's bf16 model artifact is converted to GGUF F16 by llama.cpp's own converter
(convert_hf_to_gguf.py) and quantized by llama-quantize to Q8_0 / Q5_0 / Q4_0 / Q4_K_M / IQ4_XS (and FP4, below); the
GGUFs are cached in <work dir>/<bf16 artifact id>. llmq's variants are made by the quantize stage (reused from the
store on later runs) or passed with --llmq LABEL=REF.

Speed, for every thread count and round, interleaved pair by pair (llama.cpp, then llmq):
  llama.cpp: `llama-bench -p 128 -n 128 -r 1 -t T`: pp128 = one 128-token prompt, tg128 = 128 one-token decode steps
  from an empty context (after its own warm-up runs).
  llmq: LLMEngine in-process (bench.offline.sweep, batch 1, torch threads T, after a warm-up request of the same
  length): pp128 = 128 / the time to prefill a 128-token prompt and sample its first token; tg128 = 1 / mean decode
  step over the 127 steps after a one-token prompt (contexts 2..128, as llama-bench's; fewer steps where --time-limit
  stops them).
  Pairs: F16 / llmq bf16, Q8_0 / INT8 RTN per channel, Q4_0 / INT4 RTN g64 and g32, llama.cpp's MXFP4 / NVFP4 of the
  linears (below) / llmq's. Medians over --rounds; ratio = llmq / llama.cpp.
Quality, on each held-out text (--text; by default Python source from the installed stdlib and the prose of the GNU
GPL-3 and Apache-2.0 licenses on disk, all in none of llmq's calibration, probe or eval data), windowed as
llama-perplexity does (-c 512: chunks of 512 tokens, the second half of each scored; the first --chunks of them):
  llama.cpp: `llama-perplexity --kl-divergence-base` writes F16's log-probs; `--kl-divergence` compares each GGUF to
  them (its mean KLD and "Same top p").
  llmq: LLMEngine.prompt_logprobs over the same chunks, fed the base file's tokens (llama.cpp's tokenization, so a
  text the two tokenizers split differently still scores the same predictions); each variant against llmq bf16
  (exact, float64), and against F16's base file with llama.cpp's own formula. That formula applied to llmq bf16 is
  the check that the two references agree (the base file stores log-probs to 16 bits, so a perfect match reads
  about 1e-6, not 0).
  bits/weight = file bytes x 8 / parameters (a GGUF includes its tokenizer; llmq: its safetensors).
  --gguf-exports: every llmq variant is also written as GGUF (`llmq build --target gguf`) and that file is scored by
  llama-perplexity --kl-divergence like llama.cpp's own quantizations: the quality a llama.cpp user of the export
  gets, beside what llmq's runtime computes from the artifact and what the build records as llama.cpp's CPU
  arithmetic (modelled: gguf_modelled_vs_llamacpp.llmq_side, same tokens, same base file); a calibrated variant's
  importance matrix (written beside its export) also guides `llama-quantize --imatrix` to a Q4_K_M and an IQ4_XS
  of F16, scored the same way. A variant GGUF cannot hold (FP8: no GGML block format) is named with the build
  target's reason.
  --gguf LABEL=FILE: another tool's GGUF of the same model (AutoRound's: autoround_gguf.py) scored the same way.
FP4 in llama.cpp (with the quality runs): llama-quantize's file types hold FP4 only for MoE experts (MXFP4_MOE: dense
tensors Q8_0; no NVFP4 file type in llama-cpp-python 0.3.36's llama.cpp), so llama.cpp's own MXFP4 / NVFP4 of this
dense model is ggml's block quantizer reached with `--tensor-type` on every decoder linear (the embedding table left
F16, as llmq's FP4 artifacts leave it 16-bit). Every FP4-named file type the tool lists is made too and kept as a row
only if the file holds FP4 tensors (read back with gguf-py); otherwise the report says what it wrote.

    python benchmarks/bench_vs_llamacpp.py --llama-cpp /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --converter-pythonpath /tmp/llamacpp/pydeps [--rounds 3] [--threads 1 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bench.llamacpp import LlamaCpp, LlamaCppNotFound, locate, run, scored  # noqa: E402
from llmq.errors import LlmqError  # noqa: E402

GGUF_TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_K_M", "IQ4_XS")
IMATRIX_TYPES = ("Q4_K_M", "IQ4_XS")  # llama.cpp's recipes made again with each llmq importance matrix
VARIANTS = ("int8-rtn", "int4-rtn-g64", "int8-rtn-head8", "int4-rtn-g64-head8", "int8-rtn-emb8",
            "int4-rtn-g64-emb8", "int4-gptq-g64-act", "int4-awq-g64", "int4-gptq-g32-act", "int4-rtn-g32-bpw5",
            "int4-gptq-g32-act-bpw5", "int4-gptq-g32-act-emb8", "int4-gptq-g32-act-emb8-bpw5.75", "int4-rtn-g32-emb8",
            "int8-rtn-g32-emb8g32", "fp8", "fp8-g128", "nvfp4", "mxfp4", "nvfp4-gptq-act-search",
            "mxfp4-gptq-act-search", "int5-rtn-g32-emb8", "int5-gptq-g32-act-emb8", "int4-gptq-g32-act-emb8-gguf-q4km",
            "int4-gptq-g32-act-emb8-head8-rot", "int5-gptq-g32-act-emb8-head8-rot",
            "int4-gptq-g32-act-emb8-head8-gguf-q4km-rot", "iq4xs-gptq", "iq4xs-gptq-act", "iq4xs-gptq-act-emb8",
            "int4-autoround-g32-emb8", "int5-autoround-g32-emb8", "int4-autoround-g32-emb8-head8-rot",
            "int5-autoround-g32-emb8-head8-rot", "int4-gptq-g32-act-emb8-gptaq", "int5-gptq-g32-act-emb8-gptaq")
# llmq's, besides bf16; head8: lm_head INT8 too (quantize --lm-head int8); bpw5: mixed 4/8/16 bits, --target-bpw 5;
# emb8: the tied embedding / head table INT8 per row (--embedding int8); bpw5.75 then fills Q4_K_M's file size;
# g32-emb8 / g32-emb8g32: the GGUF-shaped ones (Q4_0 / Q8_0 blocks exactly, the table in groups of 32 for the latter);
# fp8: E4M3 weights per output channel with dynamic per-token FP8 activations (--method fp8); fp8-g128: block FP8
# (128 x 128 weight blocks, --group-size 128); nvfp4 / mxfp4: FP4 E2M1 weight-only in the format's blocks (16 with E4M3
# scales and a global scale / 32 with E8M0 exponents); -gptq-act-search: rounded by GPTQ (act-order) onto the FP4 grid
# with searched block scales (--gptq --act-order --scales search); the float formats keep the embedding table 16-bit;
# int5: 5-bit integers in groups of 32 (--bits 5), GGUF's Q5_0; gguf-q4km: mixed precision across what GGUF holds (--for
# gguf: INT4 / INT5 / INT8 / NVFP4 / MXFP4 / 16-bit per unit) filling Q4_K_M's file bytes (--max-size --size-in gguf);
# rot: the residual stream rotated first (--rotate hadamard), which unties the head: INT8 too (head8), as the table;
# iq4xs: GPTQ (the grid fixed first) onto llama-quantize IQ4_XS's own format (--grid iq4_xs); autoround: the layer's
# rounding tuned by signed gradient descent (--method autoround, its default 200 steps); gptaq: GPTQ aimed at the float
# model's outputs (--gptaq)
Q4_K_M_BYTES = 105_453_952   # SmolLM2-135M-Instruct's Q4_K_M from llama-cpp-python 0.3.36's llama-quantize
UNCALIBRATED = ("rtn", "fp8", "nvfp4", "mxfp4")  # methods made without calibration data (before the speed runs)
LLAMA_FP4 = {"MXFP4": "mxfp4", "NVFP4": "nvfp4"}  # llama.cpp's FP4 block types, made by llama-quantize --tensor-type
LINEARS = r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight"  # every decoder linear (llama.cpp's names)
PAIRS = (("F16", "bf16"), ("Q8_0", "int8-rtn"), ("Q8_0", "int8-rtn-head8"), ("Q8_0", "int8-rtn-emb8"),
         ("Q4_0", "int4-rtn-g64"), ("Q4_0", "int4-rtn-g64-head8"), ("Q4_0", "int4-rtn-g64-emb8"),
         ("Q4_0", "int4-rtn-g32-emb8"), ("MXFP4 (linears)", "mxfp4"), ("NVFP4 (linears)", "nvfp4"))  # same class
# held-out texts of two kinds, in none of llmq's calibration / probe / eval sets (checked below): stdlib names or paths
TEXTS = {"python": ("copy.py", "abc.py", "contextlib.py"),
         "prose": ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")}


def variant_options() -> dict:
    from llmq.pipeline.quantize import QuantizeOptions

    return dict(zip(VARIANTS, (QuantizeOptions(bits=8, group_size=0), QuantizeOptions(bits=4, group_size=64),
                               QuantizeOptions(bits=8, group_size=0, lm_head="int8"),
                               QuantizeOptions(bits=4, group_size=64, lm_head="int8"),
                               QuantizeOptions(bits=8, group_size=0, embedding="int8"),
                               QuantizeOptions(bits=4, group_size=64, embedding="int8"),
                               QuantizeOptions(bits=4, method="gptq", group_size=64, act_order=True),
                               QuantizeOptions(bits=4, method="awq", group_size=64),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True),
                               QuantizeOptions(bits=4, group_size=32, target_bpw=5),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True, target_bpw=5),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True,
                                               embedding="int8"),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True,
                                               embedding="int8", target_bpw=5.75),
                               QuantizeOptions(bits=4, group_size=32, embedding="int8"),
                               QuantizeOptions(bits=8, group_size=32, embedding="int8", int8_group_size=32),
                               QuantizeOptions(method="fp8"), QuantizeOptions(method="fp8", group_size=128),
                               QuantizeOptions(method="nvfp4"), QuantizeOptions(method="mxfp4"),
                               *(QuantizeOptions(method=m, gptq=True, act_order=True, scales="search")
                                 for m in ("nvfp4", "mxfp4")),
                               QuantizeOptions(bits=5, group_size=32, embedding="int8"),
                               QuantizeOptions(bits=5, method="gptq", group_size=32, act_order=True,
                                               embedding="int8"),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True,
                                               embedding="int8", max_size=str(Q4_K_M_BYTES), size_in="gguf",
                                               for_engine="gguf"),
                               *(QuantizeOptions(bits=b, method="gptq", group_size=32, act_order=True,
                                                 embedding="int8", lm_head="int8", rotate="hadamard") for b in (4, 5)),
                               QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True,
                                               embedding="int8", lm_head="int8", rotate="hadamard",
                                               max_size=str(Q4_K_M_BYTES), size_in="gguf", for_engine="gguf"),
                               QuantizeOptions(bits=4, method="gptq", grid="iq4_xs"),
                               QuantizeOptions(bits=4, method="gptq", grid="iq4_xs", act_order=True),
                               QuantizeOptions(bits=4, method="gptq", grid="iq4_xs", act_order=True,
                                               embedding="int8"),
                               *(QuantizeOptions(bits=b, method="autoround", group_size=32, embedding="int8")
                                 for b in (4, 5)),
                               *(QuantizeOptions(bits=b, method="autoround", group_size=32, embedding="int8",
                                                 lm_head="int8", rotate="hadamard") for b in (4, 5)),
                               *(QuantizeOptions(bits=b, method="gptq", group_size=32, act_order=True,
                                                 embedding="int8", gptaq=True) for b in (4, 5)))))


def quantized(source, opts, store):
    """The quantize stage's artifact for (source, opts): the one an earlier run of this benchmark made, or a new one."""
    import dataclasses

    from llmq.pipeline.quantize import quantize
    from llmq.pipeline.recipe import StageCache

    key = hashlib.sha256(json.dumps({"bench": "vs-llamacpp", "parent": source.id,
                                     "options": dataclasses.asdict(opts)}, sort_keys=True).encode()).hexdigest()
    cache = StageCache(store)
    if (hit := cache.get(key)) is not None:
        return hit
    art = quantize(source, opts, store, progress=False)
    cache.put(key, art)
    return art


def quantize_types(help_text: str) -> set[str]:
    """The file types `llama-quantize --help` lists ("  38  or  MXFP4_MOE :  MXFP4 MoE" lines), upper case."""
    return {m.group(1).upper() for m in re.finditer(r"^\s*\d+\s+or\s+(\S+)\s*:", help_text, re.M)}


def fp4_args(ggml_type: str) -> list[str]:
    """llama-quantize's arguments (before the files) for llama.cpp's own FP4 quantization of a dense model: every
    decoder linear to `ggml_type` by ggml's block quantizer (round-to-nearest), the tied embedding / head table left
    F16 as llmq's FP4 artifacts leave it 16-bit. The file type given after them (Q8_0) only admits the overrides:
    llama-quantize applies --tensor-type when the file type is a quantized one; no tensor is left at it."""
    return ["--tensor-type", f"{LINEARS}={ggml_type}", "--token-embedding-type", "f16"]


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds (gguf-py), e.g. {"Q8_0": 211, "F32": 61}."""
    from collections import Counter

    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def fp4_note(name: str, types: dict[str, int]) -> str | None:
    """Why a llama.cpp "FP4" file type is not an FP4 row on this model (it wrote no FP4 tensor), or None if it is."""
    if any(t in ("MXFP4", "NVFP4") for t in types):
        return None
    held = ", ".join(f"{n} x {t}" for t, n in sorted(types.items(), key=lambda x: -x[1]))
    why = (": it puts only MoE expert tensors in MXFP4 and every other matrix in Q8_0 (src/llama-quant.cpp), so here "
           "it is Q8_0 under another name; llama.cpp's MXFP4 of the linears is the row made with --tensor-type"
           if "MOE" in name.upper() else "")
    return f"llama-quantize {name} writes no FP4 tensor on this model ({held}){why}"


def ggufs(lc: LlamaCpp, model, work: Path, threads: int, fp4: bool = False) -> tuple[dict[str, Path], dict[str, str]]:
    """F16 converted from the bf16 artifact by llama.cpp's converter, then llama-quantize's types; with `fp4` also
    llama.cpp's FP4 quantizations of the linears (LLAMA_FP4, --tensor-type) and llama-quantize's MXFP4_MOE, kept as a
    row only if it writes FP4 tensors here. Cached in `work`. Returns the files and, per FP4 name left out, why."""
    work.mkdir(parents=True, exist_ok=True)
    out = {"F16": work / "model-F16.gguf", **{t: work / f"model-{t}.gguf" for t in GGUF_TYPES}}
    if not out["F16"].is_file():
        if lc.converter is None:
            raise LlmqError(f"no {out['F16']} yet and no convert_hf_to_gguf.py beside {lc.bin_dir}: point --llama-cpp "
                            "at the llama.cpp source tree")
        tmp = out["F16"].with_suffix(".tmp")
        print(f"converting {model.ref} to GGUF F16 with {lc.converter} ...", flush=True)
        run([sys.executable, str(lc.converter), str(model.path), "--outtype", "f16", "--outfile", str(tmp)],
            "the GGUF converter (missing modules: add their directory with --converter-pythonpath)",
            env=lc.converter_env())
        tmp.replace(out["F16"])
    jobs = {t: [t] for t in GGUF_TYPES}
    notes = {}
    if fp4:
        offered = quantize_types(subprocess.run([lc.tool("llama-quantize"), "--help"], capture_output=True,
                                                text=True).stdout)
        for name, ggml_type in LLAMA_FP4.items():
            label = f"{name} (linears)"
            out[label] = work / f"model-{name}-linears.gguf"
            jobs[label] = [*fp4_args(ggml_type), "Q8_0"]
            if not any(t.startswith(name) for t in offered):  # MXFP4_MOE's own note says what it writes
                notes[name] = (f"this llama-quantize offers no {name} file type (its --help lists "
                               f"{', '.join(sorted(t for t in offered if 'FP4' in t)) or 'no FP4 type'}); the "
                               f"'{label}' row is ggml's own {name} block quantizer reached through --tensor-type")
        for t in sorted(offered):
            if "FP4" in t:
                out[t], jobs[t] = work / f"model-{t}.gguf", [t]
    for t, args in jobs.items():
        if not out[t].is_file():
            tmp = out[t].with_suffix(".tmp")
            print(f"llama-quantize {t} ...", flush=True)
            *flags, ftype = args
            run([lc.tool("llama-quantize"), *flags, str(out["F16"]), str(tmp), ftype, str(threads)], "llama-quantize")
            tmp.replace(out[t])
    for t in [t for t in jobs if t not in GGUF_TYPES]:
        if (why := fp4_note(t, tensor_types(out[t]))) is not None:
            notes[t] = why
            del out[t]
    return out, notes


# -- speed ------------------------------------------------------------------------------------------------------------
def llama_speed(lc: LlamaCpp, gguf: Path, threads: int, n: int) -> dict:
    from llmq.bench.llamacpp import parse_bench_json

    r = parse_bench_json(run([lc.tool("llama-bench"), "-m", str(gguf), "-p", str(n), "-n", str(n), "-r", "1",
                              "-t", str(threads), "-o", "json"], "llama-bench"))
    return {"pp": r[f"pp{n}"]["tokens_per_s"], "tg": r[f"tg{n}"]["tokens_per_s"], "build": r[f"pp{n}"]["build"]}


def llmq_speed(path: Path, threads: int, n: int, time_limit: float, compile: bool = False,
               int8_activations: bool = False) -> dict:
    """pp from a prompt of n tokens; tg from a prompt of one token, so the decode steps attend to the contexts
    llama-bench's tg does (1..n tokens), not to n more."""
    import torch

    from llmq.bench.offline import sweep

    torch.set_num_threads(threads)  # the engine is built and stepped on this thread
    opts = dict(hw=None, time_limit=time_limit, compile=compile, int8_activations=int8_activations)
    (pp,), settings = sweep(path, [1], n, 2, **opts)
    (tg,), _ = sweep(path, [1], 1, n, **opts)
    return {"pp": n / pp.prefill_s, "tg": tg.tokens_per_s, "decode_steps": tg.decode_steps, "dtype": settings["dtype"]}


def speed(lc, gg, paths, threads: list[int], rounds: int, n: int, time_limit: float, compile: bool = False,
          int8_activations: bool = False) -> list[dict]:
    """Interleaved rounds of llama.cpp and llmq per pair; with int8_activations llmq's quantized variants run a
    second time with them (side "llmq-a8")."""
    rows = []
    for t in threads:
        samples = {p: {"llama.cpp": [], "llmq": []} for p in PAIRS if p[1] in paths}
        for r in range(rounds):
            for pair in samples:
                g, v = pair
                a = llama_speed(lc, gg[g], t, n)
                b = llmq_speed(paths[v], t, n, time_limit, compile)
                samples[pair]["llama.cpp"].append(a)
                samples[pair]["llmq"].append(b)
                line = f"  threads {t} round {r + 1}/{rounds} {g:>6} / {v:<18} pp{n} {a['pp']:7.1f} / {b['pp']:7.1f}" \
                       f"  tg{n} {a['tg']:6.1f} / {b['tg']:6.1f}"
                if int8_activations and v != "bf16":
                    c = llmq_speed(paths[v], t, n, time_limit, compile, int8_activations=True)
                    samples[pair].setdefault("llmq-a8", []).append(c)
                    line += f"  int8 activations pp{n} {c['pp']:7.1f} tg{n} {c['tg']:6.1f}"
                print(line + " tok/s", flush=True)
        for (g, v), s in samples.items():
            med = {side: {k: statistics.median(x[k] for x in s[side]) for k in ("pp", "tg")} for side in s}
            rows.append({"threads": t, "gguf": g, "llmq": v, "median": med, "samples": s,
                         "ratio": {k: med["llmq"][k] / med["llama.cpp"][k] for k in ("pp", "tg")}})
            if "llmq-a8" in med:
                rows[-1]["ratio_a8"] = {k: med["llmq-a8"][k] / med["llama.cpp"][k] for k in ("pp", "tg")}
    return rows


# -- quality ----------------------------------------------------------------------------------------------------------
def heldout_text(names: list[str]) -> tuple[str, list[dict]]:
    """The named stdlib files (or paths), refused if llmq calibrates, probes or evaluates on them."""
    from llmq.evals import tasks
    from llmq.pipeline.quantize import calib

    used = set(calib.CALIB_STDLIB) | set(calib.PROBE_STDLIB) | set(tasks.STDLIB_FILES)
    data = (calib.DATA, Path(tasks.__file__).parent / "data")
    bundled = [p.read_text(encoding="utf-8") for d in data for p in sorted(d.glob("*.txt"))]
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, info = [], []
    for n in names:
        p = Path(n) if Path(n).is_absolute() else root / n
        if n in used:
            raise LlmqError(f"{n} is in llmq's calibration, probe or eval data; pick held-out text")
        if not p.is_file():
            raise LlmqError(f"held-out file {p} not found")
        t = p.read_text(encoding="utf-8")
        lines = [ln for ln in t.splitlines() if len(ln.strip()) > 40]
        if any(ln in b for ln in lines for b in bundled):
            raise LlmqError(f"{p} shares lines with llmq's bundled calibration / eval text; pick held-out text")
        texts.append(t)
        info.append({"file": str(p), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16], "chars": len(t)})
    return "\n\n".join(texts), info


def llama_quality(lc: LlamaCpp, f16: Path, models: dict[str, Path], text_file: Path, base_file: Path, n_ctx: int,
                  threads: int, chunks: int) -> dict:
    """llama-perplexity --kl-divergence of each GGUF in `models` against F16's base log-probs of the text's first
    `chunks` chunks (written first)."""
    from llmq.bench.llamacpp import parse_kld_output

    ppl = [lc.tool("llama-perplexity"), "-c", str(n_ctx), "-t", str(threads), "--kl-divergence-base"]
    if not base_file.is_file():
        tmp = base_file.with_suffix(".tmp")
        print("llama-perplexity: F16 base log-probs ...", flush=True)
        run(ppl[:-1] + ["--chunks", str(chunks), "-m", str(f16), "-f", str(text_file), "--kl-divergence-base",
                        str(tmp)],
            "llama-perplexity (base)")
        tmp.replace(base_file)
    out = {}
    for t, path in models.items():
        print(f"llama-perplexity --kl-divergence {t} ...", flush=True)
        out[t] = parse_kld_output(run(ppl + [str(base_file), "-m", str(path), "--kl-divergence"],
                                      f"llama-perplexity --kl-divergence ({t})"))
    return out


def gguf_exports(arts: dict, store) -> tuple[dict[str, Path], dict[str, Path], dict[str, str]]:
    """Each llmq variant's `llmq build --target gguf` file, the importance matrices written beside the calibrated
    ones, and the one-line reasons of the variants GGUF cannot hold."""
    from llmq.pipeline.targets import BuildOptions, build_engine

    files, imatrices, refused = {}, {}, {}
    for label, art in arts.items():
        if label == "bf16":
            continue
        try:
            eng = build_engine(art, store, BuildOptions(target="gguf"))
        except LlmqError as e:
            refused[label] = str(e)
            continue
        out = json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]
        files[label] = eng.path / out["file"]
        if out.get("imatrix"):
            imatrices[label] = eng.path / out["imatrix"]["file"]
    return files, imatrices, refused


def imatrix_quants(lc: LlamaCpp, f16: Path, imatrices: dict[str, Path], work: Path, threads: int) -> dict[str, Path]:
    """llama-quantize's IMATRIX_TYPES of F16 with each llmq importance matrix (`--imatrix`): llama.cpp's own
    recipes, guided by llmq's calibration; cached in `work` by the matrix file's content."""
    out = {}
    for label, imx in imatrices.items():
        digest = hashlib.sha256(imx.read_bytes()).hexdigest()[:16]
        for ftype in IMATRIX_TYPES:
            path = work / f"model-{ftype}-imatrix-{digest}.gguf"
            if not path.is_file():
                tmp = path.with_suffix(".tmp")
                print(f"llama-quantize --imatrix ({label}) {ftype} ...", flush=True)
                run([lc.tool("llama-quantize"), "--imatrix", str(imx), str(f16), str(tmp), ftype, str(threads)],
                    "llama-quantize --imatrix")
                tmp.replace(path)
            out[f"{ftype} + llmq {label} imatrix"] = path
    return out


def llmq_quality(paths: dict[str, Path], base, chs: list[list[int]], threads: int, int8_activations: bool = False
                 ) -> dict:
    """Every llmq variant over the chunks `chs` (llama.cpp's, KldBase.chunk_tokens) against llmq bf16 (exact) and
    against F16's base file (llama.cpp's formula); `paths` holds "bf16", the reference. int8_activations: every
    quantized variant a second time with them (label "<variant> +int8-act")."""
    import torch

    from llmq.bench.llamacpp import kld_vs_base, scored
    from llmq.evals.compare import mean_stderr
    from llmq.evals.kld import token_kl
    from llmq.runtime import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    sl = scored(base.n_ctx)
    cfg = dict(max_num_seqs=1, max_num_batched_tokens=base.n_ctx, max_model_len=base.n_ctx,
               enable_prefix_caching=False)
    runs = [(label, path, False) for label, path in paths.items()]  # bf16 first
    runs += [(f"{label} +int8-act", path, True) for label, path in paths.items()
             if int8_activations and label != "bf16"]
    ref, out = [], {}
    for label, path, a8 in runs:
        engine = LLMEngine(path, EngineConfig(**cfg, int8_activations=a8))
        try:
            kl, top, klf, topf, nll = [], [], [], [], []
            for i, c in enumerate(chs):
                lp = engine.prompt_logprobs(c)[sl].float()
                nll += (-lp.gather(1, torch.tensor(c[sl.start + 1:])[:, None])[:, 0]).tolist()
                a, b = kld_vs_base(base.logprobs(i), lp)
                klf += a.tolist()
                topf += b.float().tolist()
                if label == "bf16":
                    ref.append(lp)
                    continue
                a, b = token_kl(lp, ref[i])
                kl += a.tolist()
                top += b.float().tolist()
        finally:
            engine.shutdown()
        (m, se), (t1, t1se) = mean_stderr(klf), mean_stderr(topf)
        r = {"ppl": float(torch.tensor(nll).double().mean().exp()),
             "vs_f16": {"kld": m, "kld_stderr": se, "top1": 100 * t1, "top1_stderr": 100 * t1se}}
        if kl:
            (m, se), (t1, t1se) = mean_stderr(kl), mean_stderr(top)
            r.update(kld=m, kld_stderr=se, top1=100 * t1, top1_stderr=100 * t1se)
        out[label] = r
        print(f"  llmq {label}: done", flush=True)
    return out


# -- report -----------------------------------------------------------------------------------------------------------
def print_speed(rows: list[dict], rounds: int, n: int) -> None:
    print(f"\nSpeed, batch 1 (tok/s, median of {rounds} rounds; ratio = llmq / llama.cpp)")
    print(f"{'threads':>7} {'llama.cpp / llmq':<32} {'pp' + str(n):>9} {'llmq':>8} {'ratio':>6}   "
          f"{'tg' + str(n):>7} {'llmq':>7} {'ratio':>6}")
    for r in rows:
        m = r["median"]
        a8 = f"   int8 activations: pp {m['llmq-a8']['pp']:.1f} ({r['ratio_a8']['pp']:.2f}) tg " \
             f"{m['llmq-a8']['tg']:.1f} ({r['ratio_a8']['tg']:.2f})" if "ratio_a8" in r else ""
        print(f"{r['threads']:>7} {r['gguf'] + ' / ' + r['llmq']:<32} {m['llama.cpp']['pp']:>9.1f} "
              f"{m['llmq']['pp']:>8.1f} {r['ratio']['pp']:>6.2f}   {m['llama.cpp']['tg']:>7.1f} "
              f"{m['llmq']['tg']:>7.1f} {r['ratio']['tg']:>6.2f}{a8}")


def print_quality(name: str, rows: list[dict], info: dict, files: list[dict]) -> None:
    print(f"\nQuality on {name}: {info['scored_tokens']} held-out tokens ({info['chunks']} chunks of {info['n_ctx']}, "
          f"second half of each scored, llama.cpp's tokens, BOS {'added' if info['add_bos'] else 'not added'}; "
          f"text: {', '.join(Path(f['file']).name for f in files)})")
    print("reference: llama.cpp GGUFs vs F16 (llama-perplexity --kl-divergence); llmq variants vs llmq bf16 (exact); "
          "'vs F16': llmq against F16's base file by llama.cpp's formula; '(GGUF)': llmq's export of the variant, "
          "run and scored by llama.cpp like its own files, its 'vs F16' column what the build models of llama.cpp's "
          "CPU arithmetic on the file")
    print(f"{'model':<48} {'file MB':>8} {'bits/w':>6} {'PPL':>7} {'mean KLD':>9} {'±':>8} {'top-1 %':>7} "
          f"{'/Q4_K_M':>7} {'vs F16 KLD':>10} {'top-1 %':>7}")
    q4km = next(r["kld"] for r in rows if r["model"] == "llama.cpp Q4_K_M")
    for r in rows:
        kld = (f"{r['kld']:>9.5f} {r['kld_stderr']:>8.5f} {r['top1']:>7.2f} {r['kld'] / q4km:>7.3f}"
               if "kld" in r else f"{'(reference)':>34}")
        v = r.get("vs_f16") or r.get("modelled")
        vs = f" {v['kld']:>10.6f} {v['top1']:>7.2f}" + (" modelled" if "modelled" in r else "") if v else ""
        print(f"{r['model']:<48} {r['bytes'] / 1e6:>8.1f} {r['bpw']:>6.2f} {r['ppl']:>7.3f} {kld}{vs}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default=None,
                    help="llama.cpp source tree or its build/bin (default: $LLAMA_CPP_DIR, then PATH)")
    ap.add_argument("--converter-pythonpath", action="append", default=[],
                    help="a directory the GGUF converter needs on its PYTHONPATH (e.g. where sentencepiece is); "
                         "repeatable; the tree's gguf-py is added by itself")
    ap.add_argument("--model", default=None, help="llmq model reference (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    ap.add_argument("--llmq", action="append", default=[], metavar="LABEL=REF",
                    help="an llmq artifact to compare under LABEL (replaces the built-in variant of that label: "
                         f"{', '.join(['bf16', *VARIANTS])}); repeatable")
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS, metavar="LABEL",
                    help="make and compare only these llmq variants (default: all; speed: the pairs they are in)")
    ap.add_argument("--no-calibrated", action="store_true",
                    help="skip the GPTQ, AWQ and mixed-precision variants (slow to make)")
    ap.add_argument("--work-dir", default=None, help="where GGUFs and base log-probs are cached "
                    "(default: <llmq cache>/vs-llamacpp)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="pp / tg length")
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="seconds per llmq measurement: decode steps stop there (a loaded machine)")
    ap.add_argument("--text", action="append", default=None, metavar="NAME=FILES",
                    help="a held-out text: comma-separated stdlib files or paths; repeatable (default: "
                         + "; ".join(f"{k}={','.join(v)}" for k, v in TEXTS.items()) + ")")
    ap.add_argument("--chunks", type=int, default=16, help="chunks of --ctx tokens scored per text (llama-perplexity "
                    "--chunks); a shorter text is refused")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c")
    ap.add_argument("--compile", action="store_true", help="llmq's decode step compiled (EngineConfig.compile)")
    ap.add_argument("--int8-activations", action="store_true",
                    help="also run llmq's quantized variants with int8 activations (EngineConfig.int8_activations: "
                         "llama.cpp's Q8_0 arithmetic), beside the default 16-bit activations")
    ap.add_argument("--gguf-exports", action="store_true",
                    help="also export every llmq variant with `llmq build --target gguf` and score the file in "
                         "llama.cpp (llama-perplexity --kl-divergence), beside llmq's runtime on the artifact")
    ap.add_argument("--gguf", action="append", default=[], metavar="LABEL=FILE",
                    help="another tool's GGUF of the same model (e.g. autoround_gguf.py's) scored beside the rest; "
                         "repeatable")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    try:
        lc = locate(args.llama_cpp, tuple(args.converter_pythonpath))
    except LlamaCppNotFound as e:
        print(e, file=sys.stderr)
        return 2
    from llmq.artifacts import ArtifactError

    try:
        return bench(lc, args)
    except (LlmqError, ArtifactError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def quality(lc: LlamaCpp, args, gg: dict, arts: dict, store, work: Path, name: str, names: list[str],
            fp4_notes: dict) -> dict:
    """Every model's KLD on one held-out text: llama.cpp's GGUFs (and llmq's exports with --gguf-exports) scored
    by llama-perplexity, llmq's variants in its runtime, on the first --chunks chunks of llama.cpp's tokens."""
    from gguf_modelled_vs_llamacpp import llmq_side

    from llmq.bench.llamacpp import KldBase, gguf_bos
    from llmq.models import ModelSpec

    paths = {k: a.path for k, a in arts.items()}
    text, files = heldout_text(names)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    text_file = work / f"heldout-{digest}.txt"
    text_file.write_text(text, encoding="utf-8")
    base_file = work / f"F16-{digest}-c{args.ctx}x{args.chunks}.kld"
    ppl = lambda models: llama_quality(lc, gg["F16"], models, text_file, base_file, args.ctx,  # noqa: E731
                                       max(args.threads), args.chunks)
    lq = ppl({t: p for t, p in gg.items() if t != "F16"})
    others = dict(x.split("=", 1) for x in args.gguf)
    lo = ppl({k: Path(p) for k, p in others.items()})
    base = KldBase(base_file)
    if base.n_chunk < args.chunks:
        raise LlmqError(f"text {name}: {base.n_chunk} chunks of {args.ctx} tokens, fewer than --chunks {args.chunks}")
    add_bos, bos = gguf_bos(gg["F16"])
    chs = base.chunk_tokens(add_bos, bos)
    mq = llmq_quality(paths, base, chs, max(args.threads), args.int8_activations)
    params = ModelSpec.from_config(arts["bf16"].path / "config.json").num_parameters()
    rows = [{"model": "llama.cpp F16", "bytes": gg["F16"].stat().st_size, "ppl": lq[GGUF_TYPES[0]]["ppl_base"]}]
    rows += [{"model": f"llama.cpp {t}", "bytes": gg[t].stat().st_size, "tensor_types": tensor_types(gg[t]),
              **lq[t]} for t in lq]
    rows += [{"model": k, "bytes": Path(p).stat().st_size, "tensor_types": tensor_types(Path(p)), **lo[k]}
             for k, p in others.items()]
    rows += [{"model": f"llmq {k}", "bytes": sum(p.stat().st_size for p in
                                                 paths[k.removesuffix(" +int8-act")].glob("*.safetensors")),
              **r} for k, r in mq.items()]
    refused = {}
    if args.gguf_exports:
        exports, imatrices, refused = gguf_exports(arts, store)
        le = ppl(exports)
        rows += [{"model": f"llmq {k} (GGUF)", "bytes": exports[k].stat().st_size,
                  "tensor_types": tensor_types(exports[k]), **le[k],
                  "modelled": llmq_side(paths[k], base, chs, True, 4)} for k in exports]
        guided = imatrix_quants(lc, gg["F16"], imatrices, work, max(args.threads))
        lg = ppl(guided)
        rows += [{"model": f"llama.cpp {k}", "bytes": guided[k].stat().st_size, **lg[k]} for k in guided]
    for r in rows:
        r["bpw"] = r["bytes"] * 8 / params
    sl = scored(base.n_ctx)
    info = {"chunks": base.n_chunk, "n_ctx": base.n_ctx, "add_bos": add_bos,
            "scored_tokens": base.n_chunk * (sl.stop - sl.start)}
    return {"rows": rows, "heldout": files, "parameters": params, "info": info, "fp4_notes": fp4_notes,
            "no_gguf_export": refused, "agreement_llmq_bf16_vs_f16": mq["bf16"]["vs_f16"]}


def bench(lc: LlamaCpp, args) -> int:
    from llmq.artifacts import Store
    from llmq.models import cache_dir, resolve_model

    if args.rounds < 1 or min(args.threads) < 1:
        raise LlmqError("--rounds and --threads need positive integers")
    store = Store.open(args.store)
    model = resolve_model(args.model, store)
    work = Path(args.work_dir or cache_dir() / "vs-llamacpp") / model.id[:16]
    load = os.getloadavg()[0]
    print(f"llama.cpp tools: {lc.bin_dir}\nllmq model: {model.ref} ({model.id[:16]})  work dir: {work}\n"
          f"machine: {os.cpu_count()} cores, 1-minute load average {load:.2f} at start")
    fp4_pairs = [v for _, v in PAIRS if v in LLAMA_FP4.values() and (args.variants is None or v in args.variants)]
    gg, fp4_notes = ggufs(lc, model, work, max(args.threads), fp4=not args.skip_quality or bool(fp4_pairs))
    given = dict(x.split("=", 1) for x in args.llmq if "=" in x)
    if len(given) != len(args.llmq) or any("=" not in x for x in args.gguf):
        raise LlmqError("--llmq takes LABEL=REF, --gguf LABEL=FILE")
    missing = [x for x in args.gguf if not Path(x.split("=", 1)[1]).is_file()]
    if missing:
        raise LlmqError(f"--gguf: no such file: {missing[0].split('=', 1)[1]}")
    arts = {"bf16": model, **{label: store.resolve(ref) for label, ref in given.items()}}

    def make(calibrated: bool) -> None:  # RTN / FP first (the speed pairs); GPTQ / AWQ / mixed only for quality
        for label, opts in variant_options().items():
            chosen = args.variants is None or label in args.variants
            made_cold = opts.method in UNCALIBRATED and opts.target_bpw is None and not opts.gptq
            if chosen and label not in arts and made_cold != calibrated:
                print(f"llmq variant {label}: ", end="", flush=True)
                arts[label] = quantized(model, opts, store)
                print(arts[label].ref, flush=True)

    make(calibrated=False)
    results = {"settings": {"llama_cpp": str(lc.bin_dir), "model": model.ref, "model_id": model.id,
                            "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
                            "load_average_start": load, "cores": os.cpu_count(), "compile": args.compile,
                            "int8_activations": args.int8_activations}}
    if not args.skip_speed:
        missing = [v for _, v in PAIRS if v not in arts]
        if args.variants is None and missing:
            raise LlmqError(f"the speed pairs need llmq variants {', '.join(missing)}")
        print("speed (llama.cpp / llmq):", flush=True)
        results["speed"] = speed(lc, gg, {k: a.path for k, a in arts.items()}, args.threads, args.rounds,
                                 args.tokens, args.time_limit, args.compile, args.int8_activations)
    if not args.skip_quality:
        if not args.no_calibrated:
            make(calibrated=True)
        results["quality"] = {name: quality(lc, args, gg, arts, store, work, name, files.split(","), fp4_notes)
                              for name, files in (t.split("=", 1) for t in args.text or
                                                  [f"{k}={','.join(v)}" for k, v in TEXTS.items()])}
    results["settings"].update(llmq={k: a.ref for k, a in arts.items()}, load_average_end=os.getloadavg()[0])
    print(f"\nmachine load: 1-minute load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at the end "
          f"on {os.cpu_count()} cores (shared: other work ran beside this benchmark)")
    if "speed" in results:
        print_speed(results["speed"], args.rounds, args.tokens)
    for name, q in results.get("quality", {}).items():
        print_quality(name, q["rows"], q["info"], q["heldout"])
        a = q["agreement_llmq_bf16_vs_f16"]
        print(f"references agree: llmq bf16 vs llama.cpp F16 (llama.cpp's formula on F16's base file): "
              f"mean KLD {a['kld']:.2e}, top-1 {a['top1']:.2f} % (|KLD| ~1e-5 is the base file's 16-bit resolution)")
        for t, why in q["fp4_notes"].items():
            print(f"llama.cpp {t}: {why}")
        for k, why in q["no_gguf_export"].items():
            print(f"llmq {k}: no GGUF export ({why.splitlines()[0]})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    sys.exit(code)
