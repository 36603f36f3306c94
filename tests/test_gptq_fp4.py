"""GPTQ onto the FP4 grids (`llmq quantize --method nvfp4 / mxfp4 --gptq`): the sweep against a float64 reference
written from the algorithm's definition, the error it removes against round-to-nearest's on data with outlier
inputs, and the checkpoint through the same readers as round-to-nearest's (compressed-tensors' decompressor,
transformers, the runtime against a float64 model, GGUF via gguf-py): the format is the same, only the codes move.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_fp4
import torch
from click.testing import CliRunner
from helpers import make_tiny_model
from test_fp4 import E2M1, SEED, _nearest_ref, source  # noqa: F401  (source: the tiny model fixture)

from llmq import quant
from llmq.pipeline.quantize import fp4
from llmq.pipeline.quantize.fp4 import gptq_fp4

BLOCK = {"nvfp4": quant.NVFP4_BLOCK, "mxfp4": quant.MXFP4_BLOCK}
MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2   # where rounding to the E2M1 grid changes code


def _layer(n=48, k=384, tokens=1024, gen=None):
    """A weight with outlier rows and columns, and correlated inputs with a few outlier channels: (w, x) float32."""
    gen = gen or np.random.default_rng(SEED)
    w = gen.standard_normal((n, k)) * np.exp(gen.normal(0, 0.5, (n, 1)))
    w[:, gen.integers(0, k, 4)] *= 8
    x = gen.standard_normal((tokens, k)) @ (np.eye(k) + gen.standard_normal((k, k)) / np.sqrt(k))
    x[:, gen.integers(0, k, 6)] *= 12
    return torch.from_numpy(w.astype(np.float32)), torch.from_numpy(x.astype(np.float32))


def _hessian(x):
    return 2 * x.T @ x / x.shape[0]


def _gptq_ref(w: np.ndarray, h: np.ndarray, step: np.ndarray, block: int, damp: float = 0.01
              ) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ by its definition, column by column in float64, no batching: U = chol((H + damp mean(diag H) I)^-1)
    (upper); column j goes to the nearest E2M1 value of its block's step (half to even, saturating), its error
    (w_j - q_j) / U_jj goes onto the columns after it through row j of U. Returns the codes and each weight's
    magnitude in steps as it was rounded."""
    W = w.astype(np.float64).copy()
    H = h.astype(np.float64) + damp * np.mean(np.diag(h)) * np.eye(h.shape[0])
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    codes = np.zeros(W.shape, dtype=np.int64)
    rounded = np.zeros(W.shape)
    for j in range(W.shape[1]):
        s = step[:, j // block].astype(np.float64)
        rounded[:, j] = np.abs(W[:, j] / s)
        c = _nearest_ref(rounded[:, j], E2M1) + 8 * (W[:, j] < 0)
        codes[:, j] = c
        real = E2M1[c & 7] * np.where(c & 8, -1.0, 1.0) * s
        W[:, j:] -= np.outer((W[:, j] - real) / U[j, j], U[j, j:])
    return codes, rounded


def _output_error(w, qw, x):
    """The calibration-weighted error the sweep minimises: mean ||x (w - dequantized)^T||^2."""
    return ((x @ (w - quant.dequantize_fp4(qw.q, qw.scale, qw.global_scale)).T) ** 2).mean().item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sweep_matches_the_float64_reference(fmt):
    """llmq's sweep (float32, in batches of 128 columns with deferred updates) gives the float64 reference's codes
    up to the rare value that float32 puts on the other side of a rounding boundary (the rest of that row then
    follows its own errors); the scales are round-to-nearest's (their own float64 reference is test_fp4's)."""
    w, x = _layer()
    h = _hessian(x)
    rtn = fp4.quantize_weight(w, fmt)
    got = gptq_fp4(w, h, fmt)
    assert torch.equal(got.scale.view(torch.uint8), rtn.scale.view(torch.uint8))
    assert (got.global_scale is None) == (fmt == "mxfp4")
    if got.global_scale is not None:
        assert torch.equal(got.global_scale, rtn.global_scale)
    step = quant.fp4_block_scale(got.scale, got.global_scale).numpy()
    want, rounded = _gptq_ref(w.numpy(), h.double().numpy(), step, BLOCK[fmt])
    differ = got.q.numpy() != want
    rows = np.nonzero(differ.any(1))[0]
    # a row leaves the reference only at a near-tie (a weight float32 puts on the other side of a midpoint of the
    # grid), and from there its own errors go onto the rest of the row: few rows, each first differing at a tie
    assert len(rows) <= 2, f"seed {SEED}: {len(rows)} rows differ"
    for r in rows:
        j = int(np.argmax(differ[r]))
        assert np.abs(rounded[r, j] - MIDPOINTS).min() < 1e-3, f"seed {SEED}: row {r} column {j} is no tie"
    assert (got.q.numpy() != fp4.quantize_weight(w, fmt).q.numpy()).mean() > 0.05   # and it is not RTN


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_diagonal_hessian_gives_round_to_nearest_exactly(fmt):
    """With uncorrelated inputs no error can be compensated: GPTQ is round-to-nearest, bit for bit, the same format
    (codes, scales, NVFP4's global scale), also with a unit's shared global scale and act-order."""
    w, x = _layer()
    h = torch.diag(torch.diag(_hessian(x)))
    g = quant.nvfp4_global_scale(2 * w.abs().amax()) if fmt == "nvfp4" else None
    rtn = fp4.quantize_weight(w, fmt, g)
    for act_order in (False, True):
        got = gptq_fp4(w, h, fmt, g, act_order=act_order)
        assert torch.equal(got.q, rtn.q)
        assert torch.equal(got.scale.view(torch.uint8), rtn.scale.view(torch.uint8))
        assert got.group_size == rtn.group_size
        assert got.bits == 4
        assert got.symmetric
        assert got.zero_point is None
        assert (got.global_scale is None and rtn.global_scale is None) or torch.equal(got.global_scale,
                                                                                     rtn.global_scale)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_lowers_the_calibration_weighted_output_error(fmt):
    """On held-out tokens of the same distribution, with outlier inputs: GPTQ's output error is well below
    round-to-nearest's, with or without act-order (without the error feedback it would be 1x). One layer's ratio is
    heavy-tailed (over 40 seeds a layer: median 0.56x, the worst 0.89x NVFP4 / 0.94x MXFP4, so a bound on each
    layer failed now and then: 0.9x is passed by about one layer in 50), so the median over three fresh layers and
    both orders is checked against 0.9x."""
    ratios = []
    for i in range(3):
        w, x = _layer(tokens=2048, gen=np.random.default_rng([SEED, i]))
        fit, held = x[:1024], x[1024:]
        rtn = _output_error(w, fp4.quantize_weight(w, fmt), held)
        ratios += [_output_error(w, gptq_fp4(w, _hessian(fit), fmt, act_order=a), held) / rtn for a in (False, True)]
    assert float(np.median(ratios)) < 0.9, f"seed {SEED}: GPTQ / RTN output error {ratios}"


def _block_errors(w, qw, importance):
    n, k = w.shape
    d = (w.double() - quant.dequantize_fp4(qw.q, qw.scale, qw.global_scale).double()) ** 2 * importance.double()
    return d.reshape(n, -1, qw.group_size).sum(-1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_searched_scales_never_lose_to_amax_and_keep_the_format(fmt):
    """--scales search: every block's (weighted) squared error is at most amax's, lower in total; the scales are
    amax's neighbours on their own grid (E4M3 codes +-2, E8M0 exponents +-1) and the codes are the nearest ones for
    them, so the weight is the format's as any reader decodes it. With GPTQ on a diagonal Hessian it is exactly
    round-to-nearest with scales searched under diag(H)."""
    w, x = _layer()
    h = _hessian(x)
    rtn = fp4.quantize_weight(w, fmt)
    for importance in (None, torch.diag(h)):
        imp = torch.ones(w.shape[1]) if importance is None else importance
        got = fp4.quantize_weight(w, fmt, search=True, importance=importance)
        assert got.scale.dtype == rtn.scale.dtype
        assert got.scale.shape == rtn.scale.shape
        assert (got.global_scale is None) == (rtn.global_scale is None)
        moved = (got.scale.view(torch.uint8).int() - rtn.scale.view(torch.uint8).int()).abs()
        assert moved.max() <= (2 if fmt == "nvfp4" else 1)
        assert (moved > 0).any()
        step = quant.fp4_block_scale(got.scale, got.global_scale).double()
        assert torch.equal(got.q, quant.e2m1_codes(w.double().reshape(*step.shape, -1) / step.unsqueeze(-1))
                           .reshape(w.shape))
        mine, amax = _block_errors(w, got, imp), _block_errors(w, rtn, imp)
        assert (mine <= amax * (1 + 1e-12)).all(), f"seed {SEED}"
        assert mine.sum() < 0.99 * amax.sum(), f"seed {SEED}"
    diag = gptq_fp4(w, torch.diag(torch.diag(h)), fmt, search=True)
    want = fp4.quantize_weight(w, fmt, search=True, importance=torch.diag(h))
    assert torch.equal(diag.q, want.q)
    assert torch.equal(diag.scale.view(torch.uint8), want.scale.view(torch.uint8))


# -- the checkpoint ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gptq_quantized(source):  # noqa: F811
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    made = {}

    def get(method):
        if method not in made:
            made[method] = quantize(src, QuantizeOptions(method=method, gptq=True, num_samples=8, seq_len=64,
                                                         probe_tokens=256), store, progress=False)
        return made[method]

    return get


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_checkpoint_reads_back_as_round_to_nearests_does(source, gptq_quantized, method):  # noqa: F811
    """The GPTQ checkpoint passes round-to-nearest's own checks unchanged: compressed-tensors' decompressor and
    transformers' loader give llmq's weights, the runtime computes the float64 dequantize-then-matmul model, NVFP4's
    units share one global scale. It is calibrated (the manifest says on what) and its codes are not RTN's."""
    test_fp4.test_checkpoint_is_what_compressed_tensors_decompresses(gptq_quantized, method)
    test_fp4.test_transformers_loads_the_checkpoint_with_llmqs_weights(gptq_quantized, method)
    test_fp4.test_runtime_equals_a_float64_dequantize_then_matmul_model(source, gptq_quantized, method)
    if method == "nvfp4":
        test_fp4.test_nvfp4_units_share_one_global_scale_as_fused_engines_read_them(gptq_quantized)
    art = gptq_quantized(method)
    assert art.name.endswith("-gptq")
    assert art.config["options"]["gptq"] is True
    assert art.config["calibration"]["samples"] == 8


def test_gguf_export_reads_back_bit_exact(tmp_path):
    """The GGUF target writes GPTQ's FP4 weights as NVFP4 / MXFP4 blocks that gguf-py reads back bit-exact."""
    from test_export_gguf import _bf16

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    store = Store(tmp_path / "store")
    src = resolve_model(str(_bf16(make_tiny_model(tmp_path / "tiny", seed=7))), store)
    built = {}
    for method in ("nvfp4", "mxfp4"):
        art = quantize(src, QuantizeOptions(method=method, gptq=True, act_order=True, num_samples=4, seq_len=64,
                                            probe_tokens=0), store, progress=False)
        assert art.name.endswith("-gptq-act")
        built[method] = art, build_engine(art, store, BuildOptions(target="gguf"))
    for method in built:
        test_fp4.test_gguf_fp4_blocks_read_back_bit_exact(built, method)


@pytest.mark.parametrize("args, match", [
    (["--method", "gptq", "--gptq"], "--gptq / --w4a4 are the FP4 methods' options"),
    (["--method", "rtn", "--gptq"], "--gptq / --w4a4 are the FP4 methods' options"),
    (["--method", "nvfp4", "--act-order"], "add --gptq"),
    (["--method", "mxfp4", "--damp", "0.1"], "add --gptq"),
    (["--method", "awq", "--act-order"], "--act-order / --gptaq are GPTQ options"),
    (["--method", "nvfp4", "--gptq", "--bits", "8"], "quantizes to 4 bits, not 8"),
    (["--method", "nvfp4", "--gptq", "--group-size", "32"], "blocks of 16 input columns"),
    (["--method", "fp8", "--scales", "search"], "--scales is the scale rule"),
    (["--method", "nvfp4", "--gptq", "--lm-head", "int8"], "needs a weight-only method"),
    (["--method", "nvfp4", "--calib", "x.txt"], "uses no calibration data"),
])
def test_impossible_combinations_are_one_line_errors(source, args, match):  # noqa: F811
    from llmq.cli.main import cli

    store, src = source
    r = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", src.ref, *args])
    assert r.exit_code == 2, r.output
    assert match in r.output, r.output
    assert r.output.startswith("error: "), r.output
    assert r.output.strip().count("\n") == 0   # one line
