"""GGML's IQ4_XS grid and its fallback IQ4_NL (`llmq.quant`), `llmq quantize --grid iq4_xs` (RTN and GPTQ onto
them), their runtime layer and their GGUF export.

The block layouts and the dequantization are checked against gguf-py's IQ4_XS / IQ4_NL (NumPy ports of llama.cpp's
dequantize_row_iq4_xs / _nl) bit for bit, and IQ4_XS's against a float64 reference written here from ggml-common.h's
block_iq4_xs; planted layout errors must fail those checks. gguf-py has no IQ4 quantizer, so the grid searches are
held to the bytes of llama.cpp's own quantize_iq4_xs / quantize_iq4_nl on a fixed input (GOLDEN, GOLDEN_NL) and to
their rounding rules. GPTQ against RTN is held here for every GGML grid, Q4_K's too.
"""

from __future__ import annotations

import hashlib
import json
from functools import partial

import gguf
import numpy as np
import pytest
import torch
from helpers import bf16_kernels_off, runtime_logprobs

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.linear_weights import LinearWeights
from llmq.models.qconfig import parse_quantization_config, quantization_config
from llmq.models.qformat import IQ4NLWeight, IQ4XSWeight, Q4KWeight
from llmq.models.reader import CheckpointReader
from llmq.models.sharding import join_rows, split_cols, split_rows
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.gptq import gptq_iq4, gptq_q4_k
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.quantize.rtn import quantize_iq4, quantize_q4_k
from llmq.pipeline.targets import BuildOptions, build_engine

IQ4_XS, IQ4_NL = gguf.GGMLQuantizationType.IQ4_XS, gguf.GGMLQuantizationType.IQ4_NL
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)   # ggml-common.h kvalues_iq4nl


def weights(rows: int = 6, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Random rows with the sub-blocks that take the format's edge paths: all zero, constant positive, constant
    negative, one outlier; and an all-zero super-block (d = -0, every ls 32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0
    w[1, 32:64] = 0.3
    w[2, 64:96] = -0.2
    w[4, 200] = 2.0
    w[5, 256:] = 0
    return w


def gguf_py(blocks: torch.Tensor, qtype=IQ4_XS) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1).numpy(), qtype)


def reference_f64(blocks: np.ndarray) -> np.ndarray:
    """Every weight of block_iq4_xs bytes [rows, nb * 136] from the C layout, one value at a time, in float64."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 136)
    out = np.zeros((rows, b.shape[1] * 256))
    for r in range(rows):
        for i in range(b.shape[1]):
            d = float(b[r, i, 0:2].copy().view(np.float16)[0])
            blk = [int(x) for x in b[r, i]]
            scales_h = blk[2] | blk[3] << 8
            for j in range(8):
                ls = (blk[4 + j // 2] >> (4 * (j % 2))) & 15 | ((scales_h >> (2 * j)) & 3) << 4
                qs = blk[8 + 16 * j: 8 + 16 * (j + 1)]
                for ll in range(16):
                    out[r, 256 * i + 32 * j + ll] = d * (ls - 32) * KVALUES[qs[ll] & 15]
                    out[r, 256 * i + 32 * j + 16 + ll] = d * (ls - 32) * KVALUES[qs[ll] >> 4]
    return out


def test_iq4_xs_blocks_dequantize_as_gguf_py_and_the_float64_reference_bit_for_bit():
    w = weights()
    qw = quantize_iq4(w, "iq4_xs")
    blocks = qw.blocks()
    assert blocks.shape == (6, 2 * 136)
    assert blocks.dtype == torch.uint8
    ours = qw.dequantize().numpy()
    np.testing.assert_array_equal(gguf_py(blocks).view(np.int32), ours.view(np.int32))
    # every product is exact: float64 rounded to float32 is the same number
    np.testing.assert_array_equal(reference_f64(blocks.numpy()).astype(np.float32).view(np.int32),
                                  ours.view(np.int32))
    back = IQ4XSWeight.from_blocks(blocks)
    for f in ("q", "d", "ls"):
        assert torch.equal(getattr(back, f), getattr(qw, f)), f
    with pytest.raises(LlmqError, match="not GGML IQ4_XS blocks"):
        IQ4XSWeight.from_blocks(blocks[:, :-1], "x")


@pytest.mark.parametrize("planted", ["nibble_order", "scales_h_bytes", "scales_l_nibbles", "q4_k_pairing"])
def test_a_planted_layout_error_fails_the_bit_exact_check(planted):
    w = weights()
    qw = quantize_iq4(w, "iq4_xs")
    b = qw.blocks().reshape(6, 2, 136).clone()
    if planted == "nibble_order":        # weight j + 16 in the low nibble, j in the high one
        qs = b[..., 8:]
        b[..., 8:] = (qs >> 4) | (qs << 4)
    elif planted == "scales_h_bytes":    # scales_h read big endian
        b[..., 2:4] = b[..., 2:4].flip(-1)
    elif planted == "scales_l_nibbles":  # odd sub-blocks' low bits in the low nibble
        x = b[..., 4:8]
        b[..., 4:8] = (x >> 4) | (x << 4)
    else:                                # Q4_K's pairing: weights j and j + 32 of 64 share a byte
        c = qw.q.reshape(6, 2, 4, 2, 32)
        b[..., 8:] = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(6, 2, 128)
    ours = qw.dequantize().numpy()
    assert not np.array_equal(gguf_py(b), ours)
    assert not np.array_equal(reference_f64(b.reshape(6, -1).numpy()).astype(np.float32), ours)


def test_iq4_nl_blocks_dequantize_as_gguf_py_bit_for_bit():
    qw = quantize_iq4(weights(cols=352), "iq4_nl")   # 11 blocks a row: no super-block
    blocks = qw.blocks()
    assert blocks.shape == (6, 11 * 18)
    ours = qw.dequantize().numpy()
    np.testing.assert_array_equal(gguf_py(blocks, IQ4_NL).view(np.int32), ours.view(np.int32))
    back = IQ4NLWeight.from_blocks(blocks)
    assert torch.equal(back.q, qw.q)
    assert torch.equal(back.d, qw.d)
    with pytest.raises(LlmqError, match="not GGML IQ4_NL blocks"):
        IQ4NLWeight.from_blocks(blocks[:, :-1], "x")


@pytest.mark.parametrize("planted", ["nibble_order", "d_big_endian", "adjacent_pairs"])
def test_a_planted_iq4_nl_layout_error_fails_the_bit_exact_check(planted):
    qw = quantize_iq4(weights(cols=352), "iq4_nl")
    b = qw.blocks().reshape(6, 11, 18).clone()
    if planted == "nibble_order":     # weight j + 16 in the low nibble, j in the high one
        b[..., 2:] = (b[..., 2:] >> 4) | (b[..., 2:] << 4)
    elif planted == "d_big_endian":
        b[..., :2] = b[..., :2].flip(-1)
    else:                             # weights 2j and 2j + 1 share a byte
        c = qw.q.reshape(6, 11, 16, 2)
        b[..., 2:] = c[..., 0] | (c[..., 1] << 4)
    with np.errstate(invalid="ignore"):   # a misread d can be NaN
        assert not np.array_equal(gguf_py(b, IQ4_NL), qw.dequantize().numpy())


def best_index_int8(x: float) -> int:
    """ggml-quants.c's best_index_int8, one value in float32: bisect for the two table values around x, the lower one
    only where x is strictly closer to it."""
    x = np.float32(x)
    if x <= KVALUES[0]:
        return 0
    if x >= KVALUES[-1]:
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if x < KVALUES[mid] else (mid, hi)
    return lo if x - np.float32(KVALUES[lo]) < np.float32(KVALUES[hi]) - x else hi


def test_nearest_code_is_best_index_int8_ties_included():
    mids = [(a + b) / 2 for a, b in zip(KVALUES, KVALUES[1:])]
    near = [float(np.nextafter(np.float32(m), np.float32(s))) for m in mids for s in (-1e9, 1e9)]
    g = torch.Generator().manual_seed(5)
    x = torch.tensor([*mids, *near, *KVALUES, -300.0, 300.0, 0.0, -0.0, 1e-30]).float()
    x = torch.cat([x, torch.randn(2000, generator=g) * 70])
    assert torch.equal(quant.iq4_nearest(x), torch.tensor([best_index_int8(v) for v in x.tolist()]))
    assert quant.iq4_nearest(torch.tensor(mids)).tolist() == list(range(1, 16))   # a tie goes up


def golden_weights(stride: int = 7919) -> torch.Tensor:
    """A fixed input from integer arithmetic (no random generator; `stride` a prime), with constant sub-blocks (their
    candidate scales fit alike: the C code's summation order picks one, and they set their super-block's d), a zero
    sub-block, multiples of 1/64 and an all-zero super-block."""
    i = torch.arange(4 * 512, dtype=torch.float64)
    t = ((i * stride) % 2003 - 1001) / 1001
    w = (t * t * t * 0.1).float().reshape(4, 512)
    w[0, :32] = 0.3
    w[1, 32:64] = -0.2
    w[1, 64:96] = 0
    w[2, 256:] = torch.round(w[2, 256:] * 64) / 64
    w[3, :256] = 0
    return w


# sha256 of quantize_iq4_xs(golden_weights()) and quantize_iq4_nl(golden_weights(NL_STRIDE)) by llama.cpp's
# ggml-quants.c (the llama.cpp vendored in llama-cpp-python 0.3.36, built without floating-point contraction: its
# float32 sums and products as written)
GOLDEN = "298c9c102c1438cc715c50d35da56f3854fa0c37833a45a1f3b3d952a08a502e"
GOLDEN_NL = "eb2bdca76f1bac6be6f64e4b77750167be3165e211f5e6fd4777f40441ab4ca3"
NL_STRIDE = 1299709   # an input where rounding the scale to fp16 would move a code: llama.cpp's is the unrounded one


def test_iq4_xs_grid_is_llama_cpps():
    w = golden_weights()
    codes, d, ls = quant.iq4_xs_grid(w)
    blocks = quant.pack_iq4_xs(codes, d, ls).reshape(4, -1)
    assert hashlib.sha256(blocks.numpy().tobytes()).hexdigest() == GOLDEN
    assert blocks[3, :8].tolist() == [0, 0x80, 0xAA, 0xAA, 0, 0, 0, 0]   # d = -0, every ls 32


def test_iq4_nl_grid_is_llama_cpps():
    w = golden_weights(NL_STRIDE)
    codes, d = quant.iq4_nl_grid(w)
    blocks = quant.pack_iq4_nl(codes, d).reshape(4, -1)
    assert hashlib.sha256(blocks.numpy().tobytes()).hexdigest() == GOLDEN_NL
    assert blocks[3, :18].tolist() == [0, 0] + [0x88] * 16   # an all-zero block: d = 0, every code the value 1
    # d is the scale rounded to fp16, the codes chosen on the scale as it was: one differs from d's nearest
    assert (quant.iq4_codes(w, d.float()) != codes).nonzero().tolist() == [[1, 138]]


def test_iq4_xs_grid_rounding_rules():
    w = weights(rows=8, cols=512, seed=3)
    qw = quantize_iq4(w, "iq4_xs")
    assert qw.q.max() <= 15
    assert qw.ls.max() <= 63
    assert qw.d.dtype == torch.float16
    ls = qw.ls.reshape(8, 2, 8).long()
    zero = qw.d == 0
    # d = -(the largest-magnitude sub-block scale) / 32: that sub-block's ls - 32 is -32; an all-zero super-block
    # has d = 0 and every ls 32
    assert torch.equal(ls.amin(-1)[~zero], torch.zeros(int((~zero).sum()), dtype=torch.long))
    assert bool((ls[zero] == 32).all())
    assert torch.equal(qw.dequantize()[5, 256:], torch.zeros(256))
    assert bool((qw.dequantize()[0, :32] == 0).all())   # an all-zero sub-block stays zero
    # each code is the table value nearest w on its stored step, but for the ones the fp16 rounding of d moves
    # across a midpoint (llama.cpp chooses them on the unrounded d)
    step = quant.iq4_xs_steps(qw.d, qw.ls).repeat_interleave(32, 1)
    values = step.unsqueeze(-1) * quant.IQ4_VALUES
    err = (values - w.unsqueeze(-1)).abs()
    got = err.gather(-1, qw.q.long().unsqueeze(-1))[..., 0]
    assert bool((got <= err.amin(-1) + step.abs() * 127 * 2.0 ** -10).all())
    assert float((quant.iq4_codes(w, quant.iq4_xs_steps(qw.d, qw.ls)) != qw.q).float().mean()) < 0.01


# each GGML grid's RTN and GPTQ (its grid fixed first, then column by column)
GRID_METHODS = {"q4_k": (quantize_q4_k, gptq_q4_k),
                **{g: (partial(quantize_iq4, grid=g), partial(gptq_iq4, grid=g)) for g in ("iq4_xs", "iq4_nl")}}


@pytest.mark.parametrize("grid", GRID_METHODS)
def test_gptq_on_each_ggml_grid_lowers_the_output_error_of_rtn_on_it(grid):
    """In column order, and lower again in act-order (by decreasing diag(H); the grid is fixed first, so the order
    only moves where the error goes) where the columns' weights differ."""
    g = torch.Generator().manual_seed(1)
    k = 256
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(2048, k, generator=g) @ mix          # correlated inputs: what GPTQ exploits
    x[:, ::3] *= 4                                       # columns of unequal weight: act-order's case
    w = torch.randn(32, k, generator=g) * 0.05
    h = x.T @ x / x.shape[0]
    rtn_of, gptq_of = GRID_METHODS[grid]
    rtn, gptq, act = rtn_of(w), gptq_of(w, h), gptq_of(w, h, act_order=True)
    for qw in (gptq, act):
        assert type(qw) is type(rtn)                     # the same fixed-grid kind: fp16 d, codes on it
        assert qw.q.max() <= 15
        assert qw.d.dtype == torch.float16
    assert torch.equal(act.d, gptq.d)                    # one grid, fixed before the sweep: the order moves codes only
    err = lambda qw: (x @ (qw.dequantize() - w).T).pow(2).mean()  # noqa: E731
    assert err(gptq) < 0.8 * err(rtn)
    assert err(act) < 0.8 * err(gptq)


def test_iq4_xs_options_config_and_sharding():
    for kw in (dict(method="awq"), dict(bits=8), dict(group_size=64), dict(per_tensor=True)):
        with pytest.raises(LlmqError, match="iq4_xs"):
            QuantizeOptions(grid="iq4_xs", **kw).check()
    o = QuantizeOptions(grid="iq4_xs").resolved((576, 1536))
    # IQ4_XS where 256 divides the input width, else IQ4_NL as in llama.cpp, else INT4 asym g32 (Q4_1)
    assert [o.ggml_grid(k) for k in (1536, 576, 40)] == ["iq4_xs", "iq4_nl", None]
    assert (o.bits, o.group_size, o.symmetric) == (4, 32, False)
    assert QuantizeOptions(grid="q4_k").ggml_grid(576) is None
    # one config lists every grid; llmq_q4_k is the key Q4_K artifacts were written with
    grids = {"a.q_proj": "iq4_xs", "a.down_proj": "q4_k", "a.o_proj": "iq4_nl"}
    cfg = {"quantization_config": quantization_config(None, ggml=grids)}
    assert cfg["quantization_config"]["llmq_q4_k"] == ["a.down_proj"]
    assert cfg["quantization_config"]["llmq_iq4_xs"] == ["a.q_proj"]
    assert cfg["quantization_config"]["llmq_iq4_nl"] == ["a.o_proj"]
    assert parse_quantization_config(cfg).ggml == grids
    # rows split and join back; input columns are refused
    lw = LinearWeights("a.q_proj", qw=quantize_iq4(weights(cols=256)[:4], "iq4_xs"))
    halves = [split_rows(lw, torch.arange(r, r + 2)) for r in (0, 2)]
    joined = join_rows(halves, "a.q_proj").qw
    assert isinstance(joined, IQ4XSWeight)
    assert torch.equal(joined.blocks(), lw.qw.blocks())
    with pytest.raises(LlmqError, match="IQ4_XS weights are not split across input columns"):
        split_cols(lw, torch.arange(128))
    other = LinearWeights("a.k_proj", qw=Q4KWeight(*quant.unpack_q4_k(torch.zeros(2, 144, dtype=torch.uint8))))
    with pytest.raises(LlmqError, match="quantized differently"):
        join_rows([halves[0], other], "a.qk")


# ---------------------------------------------------------------- end to end: quantize -> artifact -> GGUF, runtime
@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model):
    """{method: (quantized artifact, gguf engine artifact)} of a tiny model with hidden 256 (q/k/v/o/gate/up on
    IQ4_XS) and intermediate 320 (down_proj falls back to IQ4_NL)."""
    from llmq.artifacts import Store

    store = Store(tmp_path_factory.mktemp("iq4xs") / "store")
    src = resolve_model(str(tiny_model(seed=30, name="iq4xs", hidden_size=256, intermediate_size=320)), store)
    out = {}
    for method in ("rtn", "gptq"):
        art = quantize(src, QuantizeOptions(method=method, grid="iq4_xs", num_samples=4, seq_len=64,
                                            probe_tokens=128), store, progress=False)
        out[method] = (art, build_engine(art, store, BuildOptions(target="gguf")))
    return out


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_iq4_xs_linears_are_the_gguf_files_bytes(built, method):
    art, engine = built[method]
    src = CheckpointReader(art.path)
    cfg = json.loads((art.path / "llmq.json").read_text())["config"]
    rec = json.loads((engine.path / "engine.json").read_text())["outputs"]["gguf"]
    tensors = {t.name: t for t in gguf.GGUFReader(engine.path / rec["file"]).tensors}
    for i in range(src.spec.num_layers):
        for role, fname in (("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up"),
                            ("self_attn.o_proj", "attn_output")):
            qw = src.linear(f"model.layers.{i}.{role}").qw
            t = tensors[f"blk.{i}.{fname}.weight"]
            # down_proj: 320 input columns, the fallback
            assert type(qw) is (IQ4NLWeight if role == "mlp.down_proj" else IQ4XSWeight)
            assert t.tensor_type == (IQ4_NL if role == "mlp.down_proj" else IQ4_XS)
            assert np.array_equal(np.asarray(t.data).reshape(-1), qw.blocks().numpy().reshape(-1))
    assert cfg["grid"] == "iq4_xs"
    assert cfg["grid_linears"] == 12
    assert [(fb["scheme"], fb["linears"]) for fb in cfg["grid_fallback"]] == [
        ("IQ4_NL", 2), ("INT4 asymmetric groups of 32 (GGUF Q4_1)", 0)]
    assert cfg["scheme"] == "IQ4_XS"
    assert cfg["scheme_per_module"]["model.layers.0.mlp.down_proj"] == "IQ4_NL"
    assert (rec["tensor_types"]["IQ4_XS"], rec["tensor_types"]["IQ4_NL"]) == (12, 2)
    assert "Q4_1" not in rec["tensor_types"]
    assert rec["file_type"] == "IQ4_XS"


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_runtime_computes_what_the_gguf_file_holds(built, method, monkeypatch):
    from test_export_gguf import TOKENS, exact_artifact_model, read_gguf, reader_logprobs

    from llmq.runtime.layers import cpu_kernels

    art, engine = built[method]
    rec = json.loads((engine.path / "engine.json").read_text())["outputs"]["gguf"]
    model, _ = read_gguf(engine.path / rec["file"])
    exact = reader_logprobs(exact_artifact_model(art.path), TOKENS)
    # the artifact's weights dequantized by llmq give the file's logits (IQ4_XS and IQ4_NL: the same bytes) ...
    assert kld_top1(exact, reader_logprobs(model, TOKENS))["kld_mean"] <= 1e-9
    # ... and llmq's runtime on the artifact computes them, float32 summation order apart: on table_linear (IQ4_XS's
    # 256 inputs, IQ4_NL's 320) and with the table kernel off
    bf16_kernels_off(monkeypatch)
    calls = []
    table_linear = cpu_kernels.table_linear
    monkeypatch.setattr(cpu_kernels, "table_linear", lambda *a: calls.append(a[0].shape[-1]) or table_linear(*a))
    assert kld_top1(runtime_logprobs(art.path, TOKENS), exact)["kld_mean"] <= 1e-9
    assert set(calls) == ({256, 320} if cpu_kernels.table_fits(16, 256, 32) else set())
    monkeypatch.setattr(cpu_kernels, "table_fits", lambda n, k, group: False)
    calls.clear()
    assert kld_top1(runtime_logprobs(art.path, TOKENS), exact)["kld_mean"] <= 1e-9
    assert not calls


@pytest.mark.parametrize("grid,flag", [("q4_k", "embedding"), ("iq4_xs", "lm_head")])
def test_an_int8_table_beside_grid_linears_is_written_run_and_exported(tiny_model, tmp_path, grid, flag):
    """Every layer linear on a GGML grid and an INT8 embedding / lm_head beside them: the checkpoint names the table in
    a compressed-tensors group of its own (no Linear group), the runtime computes what the probe measured, and the
    GGUF export writes it as Q8_0 beside the grid's blocks."""
    from helpers import runtime_probe_kld

    from llmq.artifacts import Store
    from llmq.pipeline.targets.stage import BuildOptions, build_engine

    store = Store(tmp_path / "store")
    src = resolve_model(str(tiny_model(seed=30, name="grid8", hidden_size=256, intermediate_size=512)), store)
    q = quantize(src, QuantizeOptions(method="rtn", grid=grid, **{flag: "int8"}, probe_tokens=128), store,
                 progress=False)
    qc = json.loads((q.path / "config.json").read_text())["quantization_config"]
    table = "model.embed_tokens" if flag == "embedding" else "lm_head"
    assert [g["targets"] for g in qc["config_groups"].values()] == [[table]]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert len(qc[f"llmq_{grid}"]) == 14   # every layer linear of the two layers
    qconf = parse_quantization_config({"quantization_config": qc})
    assert qconf.weights is None
    assert qconf.scheme_of(table)[0].num_bits == 8
    recorded = q.metrics["probe"]["kld_mean"]
    assert recorded > 1e-3
    assert abs(runtime_probe_kld(src.path, q.path, 128) / recorded - 1) < 1e-3
    e = build_engine(q, store, BuildOptions(target="gguf", probe_tokens=0))
    rec = json.loads((e.path / "engine.json").read_text())["outputs"]["gguf"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(e.path / rec["file"]).tensors}
    assert types["token_embd.weight" if flag == "embedding" else "output.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == grid.upper()
