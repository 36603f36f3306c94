"""llama.cpp's CPU arithmetic, modelled (quant.ggml_activations, pipeline/targets/gguf_compute.py), and the KLD the
GGUF build records with it.

The references are written here from ggml's C (ggml-cpu/arch/x86/quants.c quantize_row_q8_0, ggml-quants.c
quantize_row_q8_K_ref) step by step in NumPy float32, and the products in float64.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmq import quant
from llmq.models.linear_weights import LinearWeights
from llmq.pipeline.quantize.rtn import quantize_weight
from llmq.pipeline.targets.gguf_compute import GgmlLinear, file_weights

gguf = pytest.importorskip("gguf")


def q8_0_reference(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0's AVX path, block by block: id = 127 / amax, q = rint(x * id), value q * fp16(amax / 127)."""
    out = np.empty_like(x, dtype=np.float32)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            v = x[r, b:b + 32].astype(np.float32)
            amax = np.float32(np.abs(v).max())
            d = np.float16(amax / np.float32(127))
            inv = np.float32(127) / amax if amax else np.float32(0)
            out[r, b:b + 32] = np.rint(v * inv).astype(np.float32) * np.float32(d)
    return out


def q8_k_reference(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref: iscale = -127 / (the signed input of largest magnitude), q = min(127, rint(iscale * x)),
    value q * (1 / iscale)."""
    out = np.empty_like(x, dtype=np.float32)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 256):
            v = x[r, b:b + 256].astype(np.float32)
            m = v[int(np.abs(v).argmax())]
            iscale = np.float32(-127) / m
            q = np.minimum(127, np.rint(iscale * v)).astype(np.float32)
            out[r, b:b + 256] = q * (np.float32(1) / iscale)
    return out


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g).pow(4) * 5   # heavy-tailed, as activations


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "MXFP4", "Q4_1"])
def test_q8_0_activations_are_ggml_cpus_bit_for_bit(weight_type):
    x = _x(8, 256)
    x[3, :32] = 0   # an all-zero block: scale 0, values 0
    got = quant.ggml_activations(x, weight_type)
    assert np.array_equal(got.numpy(), q8_0_reference(x.numpy()))
    # not llmq's runtime int8-activation rounding (float32 scale, division): the fp16 block scale moves values
    xq, d = quant.quantize_blocks(x, 32)
    runtime = (xq.view(8, -1, 32) * d.unsqueeze(-1)).view(8, 256)
    assert not torch.equal(got, runtime)


@pytest.mark.parametrize("weight_type", ["Q4_K", "Q6_K"])
def test_q8_k_activations_are_ggml_cpus_bit_for_bit(weight_type):
    x = _x(4, 512, seed=1)
    x[1, 7], x[1, 9] = -40.0, 40.0   # equal magnitudes of both signs: the first sets the scale's sign
    got = quant.ggml_activations(x, weight_type)
    assert np.array_equal(got.numpy(), q8_k_reference(x.numpy()))
    assert (float(got[1, 7]), float(got[1, 9])) == pytest.approx((-40.0, 40.0), rel=1e-6)


def test_sixteen_bit_weights_take_activations_in_their_own_type():
    x = _x(4, 64)
    assert torch.equal(quant.ggml_activations(x, "BF16"), x.to(torch.bfloat16).float())
    assert torch.equal(quant.ggml_activations(x, "F16"), x.half().float())
    assert torch.equal(quant.ggml_activations(x, "F32"), x)
    with pytest.raises(ValueError, match="IQ9"):
        quant.ggml_activations(x, "IQ9")


@pytest.mark.parametrize("bits,group,ggml_type", [(8, 32, "Q8_0"), (8, -1, "Q8_0"), (4, 32, "Q4_0")])
def test_modelled_linear_is_decoded_blocks_times_rounded_activations(bits, group, ggml_type):
    """GgmlLinear of a GGUF-bound weight equals, in float64, the file's decoded blocks (llmq's integers times fp16
    scales) times Q8_0-rounded activations, to float32 summation error; the unrounded product is farther off than
    that by orders of magnitude."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * 0.05
    qw = quantize_weight(w, bits, group, True, torch.bfloat16)
    bias = torch.randn(48, generator=g)
    fw = file_weights(LinearWeights("lin", qw=qw, bias=bias))
    assert fw.ggml_type == ggml_type
    decoded = qw.dequantize(torch.float64)   # bf16 scales are fp16 numbers at this size: the blocks decode exactly
    assert torch.equal(fw.weight.double(), decoded)
    x = _x(16, 256, seed=4)
    got = GgmlLinear([fw])(x).double()
    xr = torch.from_numpy(q8_0_reference(x.numpy())).double()
    ref = xr @ decoded.T + bias.double()
    bound = 256 * 2.0 ** -23 * float((xr.abs() @ decoded.abs().T).max())   # float32 summation over 256 terms
    assert float((got - ref).abs().max()) <= bound
    unrounded = x.double() @ decoded.T + bias.double()
    assert float((got - unrounded).abs().max()) > 100 * bound


def test_modelled_linear_rounds_each_part_for_its_own_type():
    """q / k / v of different types (mixed precision) are separate matmuls in llama.cpp: each part's activations are
    rounded for its own type."""
    g = torch.Generator().manual_seed(5)
    q8 = file_weights(LinearWeights("a", qw=quantize_weight(torch.randn(8, 64, generator=g), 8, 32, True,
                                                            torch.bfloat16)))
    dense = file_weights(LinearWeights("b", weight=torch.randn(8, 64, generator=g).to(torch.bfloat16)))
    assert dense.ggml_type == "BF16"
    x = _x(3, 64)
    y = GgmlLinear([q8, dense])(x)
    assert torch.equal(y[:, :8], GgmlLinear([q8])(x))
    assert torch.allclose(y[:, 8:].double(), x.to(torch.bfloat16).double() @ dense.weight.double().T, atol=1e-5)


def test_gguf_build_records_llmq_and_modelled_llama_cpp_kld(tmp_path, make_tiny_model, store):
    """The engine's manifest carries both numbers over the same held-out tokens: a bf16 model computes in llmq's
    runtime exactly as its baseline (KLD 0), in llama.cpp with BF16-rounded activations (KLD > 0); an INT8 model's
    llama.cpp KLD is its own and is surfaced by `llmq build`'s output."""
    from click.testing import CliRunner
    from test_export_gguf import _bf16

    from llmq.cli.main import cli
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    model = resolve_model(str(_bf16(make_tiny_model(tmp_path / "m", seed=2, initializer_range=0.5))), store)
    dense = build_engine(model, store, BuildOptions(target="gguf", probe_tokens=256)).metrics["quality"]
    assert dense["baseline"] == model.ref
    assert dense["tokens"] == 256
    assert dense["llmq_runtime"]["kld_mean"] == pytest.approx(0, abs=1e-12)
    assert dense["llmq_runtime"]["top1"] == 1
    assert dense["llama_cpp_modelled"]["kld_mean"] > 1e-9
    assert "vec_dot_type" in dense["llama_cpp_modelled"]["arithmetic"]

    q8 = quantize(model, QuantizeOptions(method="rtn", bits=8, group_size=32, probe_tokens=0), store, progress=False)
    res = CliRunner().invoke(cli, ["--store", str(store.root), "build", q8.ref, "--target", "gguf",
                                   "--probe-tokens", "256", "--json"])
    assert res.exit_code == 0, res.output
    quality = json.loads(res.output)["metrics"]["quality"]
    rt, cpp = quality["llmq_runtime"]["kld_mean"], quality["llama_cpp_modelled"]["kld_mean"]
    assert rt > 0
    assert cpp > 0
    assert cpp != rt
    res = CliRunner().invoke(cli, ["--store", str(store.root), "build", q8.ref, "--target", "gguf",
                                   "--probe-tokens", "0", "--name", "noprobe"])
    assert res.exit_code == 0
    assert "llama.cpp CPU" not in res.output
    assert "quality" not in store.resolve("noprobe").metrics


def test_modelling_is_skipped_with_the_reason_where_memory_cannot_hold_it(tmp_path, make_tiny_model, store,
                                                                          monkeypatch):
    from click.testing import CliRunner

    from llmq.cli.main import cli
    from llmq.models import resolve_model

    model = resolve_model(str(make_tiny_model(tmp_path / "m")), store)
    monkeypatch.setattr("llmq.runtime.worker.available_memory", lambda device: 1 << 20)
    res = CliRunner().invoke(cli, ["--store", str(store.root), "build", model.ref, "--target", "gguf"])
    assert res.exit_code == 0, res.output
    assert "quality in llama.cpp not measured: modelling llama.cpp's arithmetic in float32 needs about" in res.output
    assert "0.0 GiB are available" in res.output
