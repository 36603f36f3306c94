"""benchmarks/bench_vs_llamacpp.py and llmq.bench.llamacpp without a llama.cpp build: the not-found path, finding a
build, llama-perplexity's windowing, reading llama-bench / llama-perplexity output captured from a real build
(llama.cpp 0c1e570, SmolLM2-135M Q8_0 GGUF) and its --kl-divergence-base file, the held-out text's checks, and the
offline sweep timing without the machine's peaks."""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmq.bench import llamacpp as L
from llmq.errors import LlmqError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_llamacpp.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_script(tmp_path, extra_pythonpath=()):
    env = {**os.environ, "LLAMA_CPP_DIR": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.pathsep.join([*extra_pythonpath, str(SCRIPT.parents[1])])}
    return subprocess.run([sys.executable, str(SCRIPT), "--skip-speed"], capture_output=True, text=True, env=env,
                          timeout=120)


def test_without_llama_cpp_it_says_how_to_build_it_and_exits_2(tmp_path):
    r = _run_script(tmp_path)
    assert r.returncode == 2, r.stderr
    assert "were not found in" in r.stderr
    assert str(tmp_path / "nowhere") in r.stderr
    assert "cmake --build build -j 2 --target llama-bench llama-perplexity llama-quantize" in r.stderr
    assert "Traceback" not in r.stderr
    assert "Python package is only the library" not in r.stderr


def test_every_variant_label_says_what_its_options_ask_for():
    """The labels are the rows of the published tables: each names its bits, method, group, act-order, INT8 head /
    table and budget, and its options pass the stage's own check. The float formats are named by their method (FP8's
    8 bits, FP4's 4 bits and block are the format's), GGML grids by the grid; a group in the label is a group asked
    for."""
    mod = _script()
    assert set(mod.variant_options()) == set(mod.VARIANTS)
    for label, opts in mod.variant_options().items():
        opts.check()
        if opts.method in ("fp8", "nvfp4", "mxfp4"):
            assert label.split("-")[0] == opts.method, label
            assert opts.bits is None, label
            assert (f"-g{opts.group_size}" in label) == bool(opts.group_size), label
            assert opts.method in mod.UNCALIBRATED, label
            assert opts.embedding == "keep", label
            continue
        if opts.grid == "int":
            assert label.startswith(f"int{opts.bits}-{opts.method}"), label
            assert (f"-g{opts.group_size}" in label) == bool(opts.group_size), label
        else:   # a GGML grid: its blocks are its groups
            assert label.startswith(f"{opts.grid.replace('_', '')}-{opts.method}"), label
            assert re.search(r"-g\d", label) is None, label
        assert ("-act" in label) == opts.act_order, label
        assert ("-head8" in label) == (opts.lm_head == "int8"), label
        assert ("-emb8" in label) == (opts.embedding == "int8"), label
        assert ("-gguf-q4km" in label) == (opts.for_engine == "gguf" and opts.max_size == str(mod.Q4_K_M_BYTES))
        budget = "" if opts.target_bpw is None else f"-bpw{opts.target_bpw:g}"
        assert label.endswith(budget), label
        assert ("-bpw" in label) == bool(budget), label


# `llama-quantize --help` of llama-cpp-python 0.3.36's llama.cpp (0c1e570), an excerpt of its type list
QUANTIZE_HELP = """
  --dry-run
                                      calculate and show the final quantization size without performing quantization
-----------------------------------------------------------------------------
 allowed quantization types
-----------------------------------------------------------------------------

  40  or  Q1_0    :  1.125 bpw quantization
   2  or  Q4_0    :  4.34G, +0.4685 ppl @ Llama-3-8B
  38  or  MXFP4_MOE :  MXFP4 MoE
  15  or  Q4_K_M  :  4.58G, +0.1754 ppl @ Llama-3-8B
   7  or  Q8_0    :  7.96G, +0.0026 ppl @ Llama-3-8B
   1  or  F16     : 14.00G, +0.0020 ppl @ Mistral-7B
   0  or  F32     : 26.00G              @ 7B
          COPY    : only copy tensors, no quantizing
"""


def test_quantize_types_reads_the_file_types_llama_quantize_lists():
    assert _script().quantize_types(QUANTIZE_HELP) == {"Q1_0", "Q4_0", "MXFP4_MOE", "Q4_K_M", "Q8_0", "F16", "F32"}


def test_fp4_overrides_reach_every_decoder_linear_and_leave_the_table_f16():
    """What the llama.cpp FP4 rows are made of: the --tensor-type pattern (llama-quantize regex_searches each tensor
    name) picks exactly the seven linears of every block of a Llama GGUF; the table is named F16 on its own."""
    mod = _script()
    args = mod.fp4_args("nvfp4")
    assert args[0] == "--tensor-type"
    assert args[2:] == ["--token-embedding-type", "f16"]
    pattern, ggml_type = args[1].rsplit("=", 1)
    assert ggml_type == "nvfp4"
    linears = [f"blk.{i}.{n}.weight" for i in (0, 7, 29) for n in
               ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    others = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_norm.weight",
              "blk.12.ffn_norm.weight", "rope_freqs.weight"]
    assert all(re.search(pattern, n) for n in linears)
    assert not any(re.search(pattern, n) for n in others)


def test_fp4_note_names_a_file_type_that_wrote_no_fp4_tensor():
    mod = _script()
    assert mod.fp4_note("MXFP4 (linears)", {"MXFP4": 210, "F32": 61, "F16": 1}) is None
    assert mod.fp4_note("NVFP4 (linears)", {"NVFP4": 210, "F32": 61, "F16": 1}) is None
    why = mod.fp4_note("MXFP4_MOE", {"Q8_0": 211, "F32": 61})  # what it wrote for SmolLM2-135M
    assert "MXFP4_MOE writes no FP4 tensor" in why
    assert "211 x Q8_0, 61 x F32" in why
    assert "MoE expert" in why


def test_tensor_types_counts_a_gguf_files_types(tmp_path):
    from gguf import GGMLQuantizationType as GT
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("a", np.zeros((4, 32), np.float32))
    w.add_tensor("b", np.zeros(8, np.float32))
    w.add_tensor("c", np.zeros((4, 34), np.uint8), raw_dtype=GT.Q8_0)  # 4 rows of one 34-byte Q8_0 block
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _script().tensor_types(tmp_path / "m.gguf") == {"F32": 2, "Q8_0": 1}


def test_an_installed_llama_cpp_package_alone_is_named_as_not_enough(tmp_path):
    (tmp_path / "pkgs" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "pkgs" / "llama_cpp" / "__init__.py").write_text("")
    r = _run_script(tmp_path, [str(tmp_path / "pkgs")])
    assert r.returncode == 2
    assert "llama_cpp Python package is only the library" in r.stderr
    assert "cmake" in r.stderr


def _fake_tree(root: Path, tools=L.TOOLS) -> Path:
    b = root / "build" / "bin"
    b.mkdir(parents=True)
    for t in tools:
        (b / t).write_text("#!/bin/sh\n")
        (b / t).chmod(0o755)
    (root / L.CONVERTER).write_text("")
    (root / "gguf-py").mkdir()
    return b


def test_locate_finds_tools_converter_and_gguf_py_from_the_tree_or_its_bin(tmp_path, monkeypatch):
    b = _fake_tree(tmp_path / "llama.cpp")
    for where in (tmp_path / "llama.cpp", b):
        lc = L.locate(str(where), ("/extra",))
        assert lc.bin_dir == b.resolve()
        assert lc.converter == (tmp_path / "llama.cpp" / L.CONVERTER).resolve()
        assert lc.pythonpath == (str((tmp_path / "llama.cpp" / "gguf-py").resolve()), "/extra")
        assert lc.converter_env()["PYTHONPATH"].startswith(lc.pythonpath[0] + os.pathsep + "/extra")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "llama.cpp"))
    assert L.locate().bin_dir == b.resolve()
    _fake_tree(tmp_path / "partial", tools=L.TOOLS[:2])  # no llama-quantize: not a usable build
    with pytest.raises(L.LlamaCppNotFound, match="llama-quantize"):
        L.locate(str(tmp_path / "partial"))


# -- llama-perplexity's windowing -------------------------------------------------------------------------------------
def test_chunks_and_scored_positions_match_a_hand_worked_example():
    toks = list(range(10, 20))  # 10 tokens, n_ctx 4: two whole chunks, 18 and 19 dropped
    assert L.chunks(toks, 4) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert L.scored(4) == slice(2, 3)  # position 2 predicts position 3: tokens 13 and 17 are scored
    # with BOS: BOS + 10 tokens = 11 -> two chunks, each starting with BOS in place of its first token
    assert L.chunks(toks, 4, add_bos=True, bos_id=1) == [[1, 10, 11, 12], [1, 14, 15, 16]]
    assert len(range(512)[L.scored(512)]) == 255  # 256..510: 255 scored per 512-token chunk
    with pytest.raises(LlmqError, match="at least 8 tokens"):
        L.chunks(toks[:7], 4)


# -- output captured from llama-bench / llama-perplexity --------------------------------------------------------------
BENCH_JSON = """[
  {"build_commit": "0c1e570", "model_filename": "/tmp/llamacpp/smol-Q8_0.gguf", "model_size": 143025408,
   "model_n_params": 134515008, "n_threads": 2, "n_prompt": 16, "n_gen": 0, "n_depth": 0, "avg_ns": 4549974364,
   "avg_ts": 3.516537, "stddev_ts": 0.015314, "samples_ns": [ 4535963557, 4563985171 ],
   "samples_ts": [ 3.52737, 3.50571 ]},
  {"build_commit": "0c1e570", "model_filename": "/tmp/llamacpp/smol-Q8_0.gguf", "model_size": 143025408,
   "model_n_params": 134515008, "n_threads": 2, "n_prompt": 0, "n_gen": 16, "n_depth": 0, "avg_ns": 1577098429,
   "avg_ts": 10.273747, "stddev_ts": 1.625128, "samples_ns": [ 1753499976, 1400696883 ],
   "samples_ts": [ 9.12461, 11.4229 ]}
]"""

KLD_OUT = """\
   7      10.2679 ±    0.6650       0.00487 ±    0.00250       0.00427 ±    0.00011     1.848 ±  0.064 %\
    96.415 ±  0.440 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  10.267893 ±   0.664996
Mean PPL(base)                :  10.217987 ±   0.660825
Cor(ln(PPL(Q)), ln(PPL(base))):  99.93%

====== KL divergence statistics ======
Mean    KLD:   0.004268 ±   0.000112
Maximum KLD:   0.055368
Minimum KLD:  -0.000001

====== Token probability statistics ======
Mean    Δp: -0.131 ± 0.044 %
RMS Δp    :  1.848 ± 0.064 %
Same top p: 96.415 ± 0.440 %
"""


def test_parse_llama_bench_json():
    r = L.parse_bench_json(BENCH_JSON)
    assert set(r) == {"pp16", "tg16"}
    assert r["pp16"]["tokens_per_s"] == 3.516537
    assert r["tg16"]["samples"] == [9.12461, 11.4229]
    assert r["tg16"]["threads"] == 2
    assert r["pp16"]["params"] == 134515008
    assert r["pp16"]["build"] == "0c1e570"


def test_parse_llama_perplexity_kld_summary():
    r = L.parse_kld_output(KLD_OUT)
    assert (r["kld"], r["kld_stderr"], r["top1"], r["top1_stderr"]) == (0.004268, 0.000112, 96.415, 0.44)
    assert (r["ppl"], r["ppl_base"]) == (10.267893, 10.217987)
    with pytest.raises(LlmqError, match="no 'kld' summary"):
        L.parse_kld_output(KLD_OUT.replace("Mean    KLD", "Mean KL"))


# -- the --kl-divergence-base file -------------------------------------------------------------------------------------
def _encode_row(logits: np.ndarray, nv: int) -> np.ndarray:
    """One scored position as perplexity.cpp's log_softmax(..., uint16_t * log_prob, ...) writes it."""
    lg = logits.astype(np.float32)
    mx = lg.max()
    mn = max(lg.min(), mx - 16)
    lse = np.float32(np.log(np.exp((lg - mx).astype(np.float64)).sum()))
    scale = np.float32((mx - mn) / 65535.0)
    row = np.zeros(nv, dtype="<u2")
    row[:4] = np.array([scale, mn - mx - lse], dtype="<f4").view("<u2")
    row[4:4 + len(lg)] = np.where(lg > mn, np.rint((lg - mn) / scale), 0).astype("<u2")
    return row


def _write_base(path: Path, tokens: np.ndarray, logits: np.ndarray, n_ctx: int) -> None:
    n_chunk, rows, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        f.write(tokens.astype("<i4").tobytes())
        for c in range(n_chunk):
            for r in range(rows):
                f.write(_encode_row(logits[c, r], nv).tobytes())


def test_kld_base_file_round_trip_and_llama_cpp_kld_against_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    n_ctx, n_chunk, vocab = 8, 3, 301  # odd vocab: rows are padded to an even count
    rows = len(range(n_ctx)[L.scored(n_ctx)])
    base_logits = 3 * torch.randn(n_chunk, rows, vocab, generator=g)
    model_logits = base_logits + 0.7 * torch.randn(n_chunk, rows, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n_chunk * n_ctx,), generator=g).numpy()
    _write_base(tmp_path / "b.kld", tokens, base_logits.numpy(), n_ctx)
    base = L.KldBase(tmp_path / "b.kld")
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.rows) == (n_ctx, vocab, n_chunk, rows)
    assert base.tokens.tolist() == tokens.tolist()
    for c in range(n_chunk):
        lp_b = torch.log_softmax(base_logits[c].double(), -1)
        kept = (lp_b > lp_b.max(-1, keepdim=True).values - 16 + 1e-3).numpy()  # the rest is stored as the minimum
        assert 0 < (~kept).sum()
        assert kept.mean() > 0.9
        err = np.abs(base.logprobs(c) - lp_b.numpy())
        assert err[kept].max() < 16 / 65535  # 16-bit steps over a 16-nat range
        lp_m = torch.log_softmax(model_logits[c], -1)
        kl, same = L.kld_vs_base(base.logprobs(c), lp_m)
        exact = (lp_b.exp() * (lp_b - lp_m.double())).sum(-1)
        assert exact.min() > 0.05  # far from zero, so the tolerance below separates right from wrong
        assert (kl - exact).abs().max() < 2e-3
        reverse = (lp_m.double().exp() * (lp_m.double() - lp_b)).sum(-1)  # the wrong direction
        assert (kl - reverse).abs().max() > 1e-2
        assert same.tolist() == (lp_m.argmax(-1) == lp_b.argmax(-1)).tolist()
        self_kl, self_same = L.kld_vs_base(base.logprobs(c), lp_b.float())
        assert self_kl.abs().max() < 1e-3
        assert bool(self_same.all())
    # the chunks as llama.cpp evaluated them: its own tokens, the first of each replaced by BOS where it adds one
    per_chunk = tokens.reshape(n_chunk, n_ctx).tolist()
    assert base.chunk_tokens(False, None) == per_chunk
    assert base.chunk_tokens(True, 7) == [[7] + c[1:] for c in per_chunk]
    # llama.cpp's tokens vs llmq's tokens of the same text
    ids = tokens.tolist() + [5, 6]
    assert base.add_bos(ids, bos_id=None) is False
    assert base.add_bos(ids[1:], bos_id=ids[0]) is True
    with pytest.raises(LlmqError, match="differ from llmq's at position 3"):
        base.add_bos(ids[:3] + [ids[3] + 1] + ids[4:], bos_id=None)
    (tmp_path / "short.kld").write_bytes((tmp_path / "b.kld").read_bytes()[:-2])
    with pytest.raises(LlmqError, match="header promises"):
        L.KldBase(tmp_path / "short.kld")
    (tmp_path / "junk.kld").write_bytes(b"not a logits file at all")
    with pytest.raises(LlmqError, match="is not a `llama-perplexity --kl-divergence-base` file"):
        L.KldBase(tmp_path / "junk.kld")


@pytest.mark.parametrize("add_bos", [True, False])
def test_gguf_bos_reads_the_tokenizer_keys_llama_perplexity_reads(tmp_path, add_bos):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_add_bos_token(add_bos)
    w.add_bos_token_id(5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert L.gguf_bos(tmp_path / "t.gguf") == (add_bos, 5)


# -- the held-out text -------------------------------------------------------------------------------------------------
def test_heldout_text_refuses_files_llmq_calibrates_probes_or_evaluates_on():
    from llmq.evals.tasks import STDLIB_FILES
    from llmq.pipeline.quantize.calib import CALIB_STDLIB, PROBE_STDLIB

    mod = _script()
    for names in mod.TEXTS.values():   # enough for 16 chunks of 512 tokens (about 3.5 characters a token)
        if not all(Path(n).is_file() for n in names if Path(n).is_absolute()):
            continue   # the prose is the system's license texts (/usr/share/common-licenses on Debian and Ubuntu)
        text, files = mod.heldout_text(list(names))
        assert len(files) == len(names)
        assert all(len(f["sha256"]) == 16 for f in files)
        assert len(text) > 16 * 512 * 4
    for used in (CALIB_STDLIB[0], PROBE_STDLIB[0], STDLIB_FILES[0]):
        with pytest.raises(LlmqError, match="calibration, probe or eval"):
            mod.heldout_text([used])


def test_heldout_text_refuses_a_file_sharing_lines_with_bundled_data(tmp_path):
    from llmq.pipeline.quantize.calib import DATA

    line = next(ln for ln in (DATA / "calib_en.txt").read_text().splitlines() if len(ln) > 60)
    (tmp_path / "x.py").write_text(f"# header\n{line}\n")
    with pytest.raises(LlmqError, match="shares lines"):
        _script().heldout_text([str(tmp_path / "x.py")])


# -- llmq's side of the speed table -----------------------------------------------------------------------------------
def test_offline_sweep_times_without_the_machine_peaks(tiny_model_dir, monkeypatch):
    from llmq.bench import hw, offline

    monkeypatch.setattr(hw, "hardware", lambda *a, **k: pytest.fail("no peaks should be measured"))
    (r,), settings = offline.sweep(tiny_model_dir, [1], 12, 6, hw=None)
    assert r.decode_steps == 5
    assert r.prefill_s > 0
    assert r.tokens_per_s == pytest.approx(1e3 / r.step_ms)
    assert r.mbu is None
    assert r.mfu is None
    assert settings["peak_read_bandwidth"] is None
