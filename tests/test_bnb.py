"""bitsandbytes NF4 / LLM.int8 (`llmq quantize --method bnb-nf4 / bnb-int8`): the artifact is what transformers'
BitsAndBytesConfig writes, transformers reproduces llmq's runtime on it, and the runtime's arithmetic is
bitsandbytes' own."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch
from click.testing import CliRunner
from helpers import llmq_logits

from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.models import bnbformat, resolve_model
from llmq.models.checkpoint import load_state_dict, read_config
from llmq.models.linear_weights import LinearWeights
from llmq.models.reader import CheckpointReader
from llmq.models.sharding import split_rows
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.runtime.layers import cpu_kernels
from llmq.runtime.layers.bnb import LLMInt8Linear, NF4Linear

bnb = pytest.importorskip("bitsandbytes", reason="the bnb extra (pip install 'llmq[bnb]') is part of the test extra")
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402

PROBE = {"probe_tokens": 256}


@pytest.fixture
def tiny_source(store, tmp_path, make_tiny_model):
    return resolve_model(str(make_tiny_model(tmp_path / "tiny", seed=3)), store)


def _nf4(w: torch.Tensor, blocksize: int, double_quant: bool) -> bnbformat.NF4Weight:
    packed, state = bnb.functional.quantize_4bit(w, blocksize=blocksize, compress_statistics=double_quant,
                                                 quant_type="nf4", quant_storage=torch.uint8)
    stored = {f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    return bnbformat.NF4Weight({"weight": packed} | stored), state


@pytest.mark.parametrize("shape,blocksize,double_quant,dtype", [
    ((96, 64), 64, False, torch.float32), ((200, 48), 64, True, torch.float32), ((40, 200), 128, True, torch.bfloat16),
    ((512, 256), 256, True, torch.float32), ((24, 640), 128, False, torch.bfloat16),
    ((48, 256), 64, True, torch.bfloat16), ((32, 128), 64, False, torch.float16)])
def test_nf4_dequantization_equals_bitsandbytes(shape, blocksize, double_quant, dtype):
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 0.1).to(dtype)
    nf4, state = _nf4(w, blocksize, double_quant)
    absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset if double_quant else (
        state.absmax)
    # bitsandbytes' reference implementation (its CPU kernel misplaces blocks that straddle rows: 48 % 64, 70 % 128)
    ref = _dequantize_4bit_compute(nf4.packed.reshape(-1), absmax, state.code, blocksize, shape, dtype)
    assert ref.dtype == dtype
    assert torch.equal(nf4.dequantize(dtype), ref)
    assert nf4.shape == shape
    assert nf4.scheme == f"NF4-block{blocksize}" + ("-dq" if double_quant else "")
    whole_blocks = shape[1] % blocksize == 0
    if whole_blocks:
        assert torch.equal(bnb.functional.dequantize_4bit(nf4.packed, state), ref)
    with mock.patch.object(cpu_kernels, "table_fits", lambda *a: False):
        layer = NF4Linear(nf4, None, torch.float32, "cpu")
    assert (layer.ops is not None) == whole_blocks                     # bitsandbytes' kernel where it is right
    assert torch.equal(layer.dequantized(), ref.float())
    layer.ops = None
    assert torch.equal(layer.dequantized(), ref.float())               # llmq.quant's torch fallback
    rel = (ref.double() - w.double()).norm() / w.double().norm()
    assert 0.02 < rel < 0.15  # NF4's error on Gaussian weights: quantized, not a copy
    # llmq's packed kernel (whole blocks a row, 16-row tiles, AVX-512 or AVX2 + F16C): that dequantized weight (rounded
    # to the checkpoint's dtype) times float32 x, up to float32 summation
    packed = NF4Linear(nf4, None, torch.float32, "cpu")
    flags = cpu_kernels.cpu_flags()
    assert packed.table == (whole_blocks and shape[0] % 16 == 0 and
                            ("avx512bw" in flags or {"avx2", "fma", "f16c"} <= flags))
    if packed.table:
        x = torch.randn(5, shape[1]) * torch.rand(1, shape[1]) * 4
        want, size = x.double() @ ref.double().t(), x.double().abs() @ ref.double().abs().t()
        assert bool(((packed(x).double() - want).abs() <= 2 * shape[1] * 2 ** -24 * size).all())


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_llm_int8_layer_equals_bitsandbytes_matmul(rows, threshold):
    torch.manual_seed(rows)
    n, k = 96, 256
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n) * 0.1
    q, scb, _ = bnb.functional.int8_vectorwise_quant(w.half())
    x = torch.randn(rows, k)
    x[:, [5, 77]] = torch.tensor([25.0, -30.0]) + torch.randn(rows, 2)  # two outlier columns (|x| >= 6)
    state = bnb.MatmulLtState()
    state.CB, state.SCB, state.threshold, state.has_fp16_weights, state.is_training = q, scb, threshold, False, False
    ref = bnb.matmul(x, q, state=state, threshold=threshold, bias=bias)
    layer = LLMInt8Linear(bnbformat.Int8Weight(q, scb, threshold), bias, torch.float32, "cpu")
    got = layer(x)
    # Up to 8 rows the int8 products run on the CPU int8 kernel, whose bfloat16 output rounds the sums (2^-8)
    tol = 4e-3 if rows <= layer.max_kernel_rows and layer.cpu_kernel else 1e-6
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    err, ref_err = (got - exact).norm() / exact.norm(), (ref - exact).norm() / exact.norm()
    assert err < 1.5 * ref_err + 1e-3  # as far from exact as bitsandbytes is
    if threshold:  # the outlier columns really are kept in floating point: dropping them is much worse
        plain = LLMInt8Linear(bnbformat.Int8Weight(q, scb, 0.0), bias, torch.float32, "cpu")(x)
        assert (plain - exact).norm() / exact.norm() > 3 * err


def _transformers_quantized(src, tmp_path, **kw):
    """What transformers' own BitsAndBytesConfig + save_pretrained writes for the same model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=BitsAndBytesConfig(**kw),
                                                 device_map="cpu", dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf-bnb")
    return load_state_dict(tmp_path / "hf-bnb"), read_config(tmp_path / "hf-bnb")["quantization_config"]


@pytest.mark.parametrize("opts,hf", [
    ({"method": "bnb-nf4", "double_quant": True},
     {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
      "bnb_4bit_compute_dtype": torch.float32, "llm_int8_skip_modules": ["lm_head"]}),
    ({"method": "bnb-nf4"}, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                             "bnb_4bit_compute_dtype": torch.float32, "llm_int8_skip_modules": ["lm_head"]}),
    ({"method": "bnb-int8"}, {"load_in_8bit": True, "llm_int8_skip_modules": ["lm_head"]})])
def test_artifact_is_what_transformers_writes_and_reproduces_llmq(store, tiny_source, tmp_path, opts, hf):
    from transformers import AutoModelForCausalLM

    art = quantize(tiny_source, QuantizeOptions(**opts, **PROBE), store, progress=False)
    ours = load_state_dict(art.path)
    theirs, their_qc = _transformers_quantized(tiny_source.path, tmp_path, **hf)
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype, k
        assert torch.equal(ours[k], theirs[k]), k
    assert read_config(art.path)["quantization_config"] == their_qc
    assert art.config["format"] == "bitsandbytes"
    assert art.parents == [tiny_source.id]
    m = art.metrics
    assert m["size_bytes"] < m["source_bytes"]
    assert m["probe"]["tokens"] > 200
    # tiny 64-wide layers: the code tables weigh
    assert m["linear_ratio_vs_bf16"] > (2.5 if opts["method"] == "bnb-nf4" else 1.85)

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    runtime = llmq_logits(art.path, ids)
    model = AutoModelForCausalLM.from_pretrained(str(art.path), device_map="cpu", dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(ids).logits
    agree = kld_top1(hf_logits, runtime)
    assert agree["kld_mean"] <= 1e-3
    assert agree["top1"] >= 0.95
    source = kld_top1(llmq_logits(tiny_source.path, ids), runtime)  # the quantization itself moves far more
    assert source["kld_mean"] > 10 * max(agree["kld_mean"], 1e-5)


def test_runtime_without_bitsandbytes_computes_the_same(store, tiny_source, monkeypatch):
    art = quantize(tiny_source, QuantizeOptions(method="bnb-nf4", double_quant=True, **PROBE), store, progress=False)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with_bnb = llmq_logits(art.path, ids)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    assert torch.equal(llmq_logits(art.path, ids), with_bnb)
    with pytest.raises(LlmqError, match=r"pip install 'llmq\[bnb\]'"):
        quantize(tiny_source, QuantizeOptions(method="bnb-int8", **PROBE), store, progress=False)
    res = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", tiny_source.ref, "--method", "bnb-nf4"])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1
    assert "llmq[bnb]" in res.output


@pytest.mark.parametrize("args,match", [
    (["--method", "rtn", "--double-quant"], "--double-quant / --compute-dtype are bitsandbytes 4-bit options"),
    (["--method", "bnb-int8", "--compute-dtype", "bfloat16"], "use them with --method bnb-nf4"),
    (["--method", "bnb-nf4", "--int8-threshold", "4"], "use it with --method bnb-int8"),
    (["--method", "bnb-nf4", "--bits", "8"], "quantizes to 4 bits, not 8"),
    (["--method", "bnb-nf4", "--group-size", "32"], "bnb-nf4 quantizes blocks of 64, 128"),
    (["--method", "bnb-nf4", "--asym"], "drop --asym"),
    (["--method", "bnb-int8", "--group-size", "64"], "one symmetric scale per output row"),
])
def test_impossible_bnb_options_are_one_line_errors(store, tiny_source, args, match):
    res = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", tiny_source.ref, *args])
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1, res.output
    assert match in res.output, res.output
    assert store.list(kind="quantized") == []


def test_bnb_artifacts_refuse_build_quantize_kv_and_tensor_parallel(store, tiny_source):
    art = quantize(tiny_source, QuantizeOptions(method="bnb-int8", int8_threshold=4.0, **PROBE), store,
                   progress=False)
    assert art.config["options"]["int8_threshold"] == 4.0
    assert read_config(art.path)["quantization_config"]["llm_int8_threshold"] == 4.0
    for cmd in (["build", art.ref], ["quantize-kv", art.ref, "--kv", "int8"]):
        res = CliRunner().invoke(cli, ["--store", str(store.root), *cmd])
        assert res.exit_code == 2
        assert res.output.count("\n") == 1
        assert "bitsandbytes checkpoint" in res.output
    lw = CheckpointReader(art.path).linear("model.layers.0.mlp.up_proj")
    assert isinstance(lw.qw, bnbformat.Int8Weight)
    assert lw.qw.threshold == 4.0
    with pytest.raises(LlmqError, match="not split for tensor parallelism"):
        split_rows(lw, torch.arange(4))
    dense = CheckpointReader(art.path).linear("lm_head")
    assert isinstance(dense, LinearWeights)
    assert dense.qw is None
