"""GGML's Q4_K grid (`llmq.quant`), `llmq quantize --grid q4_k` (RTN and GPTQ onto it) and its GGUF export.

The block layout and the dequantization are checked against gguf-py's Q4_K (a NumPy port of llama.cpp's
dequantize_row_q4_K) bit for bit, and against a float64 reference written here from ggml-common.h's block_q4_K and
ggml-quants.c's get_scale_min_k4; planted layout errors must fail those checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import bf16_kernels_off, runtime_logprobs

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.qformat import Q4KWeight
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.quantize.rtn import quantize_q4_k
from llmq.pipeline.targets import BuildOptions, build_engine

Q4_K = gguf.GGMLQuantizationType.Q4_K


def weights(rows: int = 6, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Random rows with the sub-blocks that take the format's edge paths: all zero, constant positive, constant
    negative, all positive (no zero in range), one outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0
    w[1, 32:64] = 0.3
    w[2, 64:96] = -0.2
    w[3, 96:128] = w[3, 96:128].abs() + 0.1
    w[4, 200] = 2.0
    return w


def gguf_py(blocks: torch.Tensor) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1).numpy(), Q4_K)


def reference_f64(blocks: np.ndarray) -> np.ndarray:
    """Every weight of block_q4_K bytes [rows, nb * 144] from the C layout, one value at a time, in float64."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 144)
    out = np.zeros((rows, b.shape[1] * 256))
    for r in range(rows):
        for i in range(b.shape[1]):
            blk = b[r, i]
            d = float(blk[0:2].copy().view(np.float16)[0])
            dmin = float(blk[2:4].copy().view(np.float16)[0])
            scales, qs = blk[4:16], blk[16:]
            for j in range(8):   # get_scale_min_k4
                if j < 4:
                    sc, m = scales[j] & 63, scales[j + 4] & 63
                else:
                    sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
                    m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
                chunk, high = divmod(j, 2)   # sub-block j: chunk j // 2 of 32 bytes, low nibbles first
                for ll in range(32):
                    byte = qs[32 * chunk + ll]
                    n = (byte >> 4) if high else (byte & 0xF)
                    out[r, 256 * i + 32 * j + ll] = d * sc * n - dmin * m
    return out


def test_q4_k_blocks_dequantize_as_gguf_py_and_the_float64_reference_bit_for_bit():
    w = weights()
    qw = quantize_q4_k(w)
    blocks = qw.blocks()
    assert blocks.shape == (6, 2 * 144)
    assert blocks.dtype == torch.uint8
    ours = qw.dequantize().numpy()
    np.testing.assert_array_equal(gguf_py(blocks).view(np.int32), ours.view(np.int32))
    # every product is exact and the subtraction rounds once: float64 rounded to float32 is the same number
    np.testing.assert_array_equal(reference_f64(blocks.numpy()).astype(np.float32).view(np.int32),
                                  ours.view(np.int32))
    back = Q4KWeight.from_blocks(blocks)
    for f in ("q", "d", "dmin", "sc", "m"):
        assert torch.equal(getattr(back, f), getattr(qw, f)), f


def test_q4_k_grid_is_llama_cpps_rounding_and_within_half_a_step():
    w = weights(rows=8, cols=256, seed=3)
    qw = quantize_q4_k(w)
    assert qw.q.max() <= 15
    assert qw.sc.max() <= 63
    assert qw.m.max() <= 63
    assert qw.d.dtype == qw.dmin.dtype == torch.float16
    s, mn = quant.q4_k_scale_min(qw.d, qw.dmin, qw.sc, qw.m)
    assert torch.equal(quant.q4_k_codes(w, s, mn), qw.q)   # round((w + mn) / s), clamped: the nearest code
    deq = qw.dequantize()
    step = s.repeat_interleave(32, 1)
    inside = (w >= -mn.repeat_interleave(32, 1)) & (w <= 15 * step - mn.repeat_interleave(32, 1))
    assert ((deq - w).abs() <= step / 2 * (1 + 1e-6) + 1e-7)[inside].all()
    assert torch.equal(deq[0, :32], torch.zeros(32))   # an all-zero sub-block stays exactly zero
    # the searched grid beats min/max-to-15-steps per sub-block (compressed-tensors' observer) on squared error
    lo, hi = w.view(-1, 32).amin(1, keepdim=True).clamp(max=0), w.view(-1, 32).amax(1, keepdim=True)
    sc = ((hi - lo) / 15).clamp_min(1e-12)
    naive = (torch.round((w.view(-1, 32) - lo) / sc).clamp(0, 15) * sc + lo).view_as(w)
    assert (deq - w).pow(2).sum() < (naive - w).pow(2).sum()


@pytest.mark.parametrize("planted", ["nibble_order", "scale_high_bits", "min_low_nibbles", "d_dmin_swapped"])
def test_a_planted_layout_error_fails_the_bit_exact_check(planted):
    w = weights()
    qw = quantize_q4_k(w)
    b = qw.blocks().reshape(6, 2, 144).clone()
    if planted == "nibble_order":      # weights j and j + 32 of a chunk swapped (the Q4_0 habit: j and j + 16)
        qs = b[..., 16:]
        b[..., 16:] = (qs >> 4) | (qs << 4)
    elif planted == "scale_high_bits":  # sc[4..7]'s top bits put into bytes 4-7 (m's) instead of 0-3
        top = b[..., 4:8] & 0xC0
        b[..., 4:8] = (b[..., 4:8] & 63) | (b[..., 8:12] & 0xC0)
        b[..., 8:12] = (b[..., 8:12] & 63) | top
    elif planted == "min_low_nibbles":  # bytes 8-11 with sc / m nibbles the other way round
        x = b[..., 12:16]
        b[..., 12:16] = (x >> 4) | (x << 4)
    else:
        b[..., 0:4] = torch.cat([b[..., 2:4], b[..., 0:2]], -1)
    ours = qw.dequantize().numpy()
    assert not np.array_equal(gguf_py(b), ours)
    assert not np.array_equal(reference_f64(b.reshape(6, -1).numpy()).astype(np.float32), ours)


def test_q4_k_options_are_refused_in_one_line_where_the_grid_does_not_apply():
    for kw in (dict(method="awq"), dict(bits=8), dict(group_size=64), dict(per_tensor=True)):
        with pytest.raises(LlmqError, match="q4_k"):
            QuantizeOptions(grid="q4_k", **kw).check()
    o = QuantizeOptions(grid="q4_k").resolved((576, 1536))
    assert (o.bits, o.group_size, o.symmetric) == (4, 32, False)   # the fallback: INT4 asym g32 (Q4_1)


# ---------------------------------------------------------------- end to end: quantize -> artifact -> GGUF
@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model):
    """{(model, method): (quantized artifact, gguf engine artifact)}: "mixed" has hidden 64 (q/k/v/o/gate/up fall
    back to INT4 asym g32) and intermediate 256 (down_proj on Q4_K); "all" has every width 256."""
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("q4k")
    store = Store(root / "store")
    models = {"mixed": dict(intermediate_size=256),
              "all": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)}
    out = {}
    for i, (name, kw) in enumerate(models.items()):
        src = resolve_model(str(tiny_model(seed=20 + i, name=name, **kw)), store)
        for method in ("rtn", "gptq"):
            art = quantize(src, QuantizeOptions(method=method, grid="q4_k", num_samples=4, seq_len=64,
                                                probe_tokens=128), store, progress=False)
            out[name, method] = (art, build_engine(art, store, BuildOptions(target="gguf")))
    return out


def _gguf(engine) -> Path:
    (f,) = engine.path.glob("*.gguf")
    return f if "imatrix" not in f.name else next(p for p in engine.path.glob("*.gguf") if p != f)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("model", ["mixed", "all"])
def test_q4_k_linears_read_back_from_gguf_bit_exact(built, model, method):
    art, engine = built[model, method]
    src = CheckpointReader(art.path)
    cfg = json.loads((art.path / "llmq.json").read_text())["config"]
    rec = json.loads((engine.path / "engine.json").read_text())["outputs"]["gguf"]
    r = gguf.GGUFReader(engine.path / rec["file"])
    tensors = {t.name: t for t in r.tensors}
    n_q4k = 0
    for i in range(src.spec.num_layers):
        for role, fname in (("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up"), ("self_attn.v_proj", "attn_v")):
            qw = src.linear(f"model.layers.{i}.{role}").qw
            t = tensors[f"blk.{i}.{fname}.weight"]
            if role == "mlp.down_proj" or model == "all":
                assert isinstance(qw, Q4KWeight)
                assert t.tensor_type == Q4_K
                n_q4k += 1
                got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(qw.shape)
                np.testing.assert_array_equal(got.view(np.int32), qw.dequantize().numpy().view(np.int32))
            else:   # fallback: 64 input columns
                assert not isinstance(qw, Q4KWeight)
                assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert n_q4k == (2 if model == "mixed" else 6)
    assert cfg["grid_linears"] == (2 if model == "mixed" else 14)
    assert cfg["grid"] == "q4_k"
    assert [fb["linears"] for fb in cfg["grid_fallback"]] == [12 if model == "mixed" else 0]   # INT4 only
    assert rec["tensor_types"]["Q4_K"] == cfg["grid_linears"]
    assert rec["file_type"] == "Q4_K_S"


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_runtime_computes_what_the_gguf_file_holds(built, method, monkeypatch):
    from test_export_gguf import TOKENS, exact_artifact_model, read_gguf, reader_logprobs

    art, engine = built["all", method]
    rec = json.loads((engine.path / "engine.json").read_text())["outputs"]["gguf"]
    model, _ = read_gguf(engine.path / rec["file"])
    from_file = reader_logprobs(model, TOKENS)
    # the artifact's weights dequantized by llmq give the file's logits (the same numbers in the same graph) ...
    assert torch.equal(reader_logprobs(exact_artifact_model(art.path), TOKENS), from_file)
    # ... and llmq's runtime on the artifact computes them: on its exact path, float32 rounding apart (its own
    # attention); on q4k_linear, bfloat16(x)'s rounding apart
    kernel = runtime_logprobs(art.path, TOKENS)
    bf16_kernels_off(monkeypatch)
    assert kld_top1(runtime_logprobs(art.path, TOKENS), from_file)["kld_mean"] <= 1e-6
    assert kld_top1(kernel, from_file)["kld_mean"] <= 1e-4
