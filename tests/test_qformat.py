"""The compressed-tensors reader/writer: exact round trips, compressed-tensors' own decoder agrees, bad configs
refused."""

import pytest
import torch

from llmq.errors import LlmqError
from llmq.models import qformat as qf


def _random_qw(gen, bits, symmetric, group, n=48, k=64, act=None):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    g = k // group if group else 1
    scale = (torch.rand(n, g, generator=gen) + 0.1).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(lo, hi, (n, g), generator=gen, dtype=torch.int8)
    return qf.QuantizedWeight(q, scale, zero, bits, group, symmetric,
                              input_scale=torch.tensor([0.02]) if act == "static" else None, dynamic=act == "dynamic")


CASES = [(4, True, 32, None), (4, False, 16, None), (8, True, None, None), (8, False, None, None),
         (8, True, None, "dynamic"), (8, True, None, "static")]


@pytest.mark.parametrize("bits,symmetric,group,act", CASES)
def test_round_trip_is_exact_and_matches_compressed_tensors_decoder(bits, symmetric, group, act):
    from compressed_tensors.quantization import QuantizationArgs, dequantize

    gen = torch.Generator().manual_seed(bits * 10 + int(symmetric) + (group or 0))
    qw = _random_qw(gen, bits, symmetric, group, act=act)
    weights = qf.QuantArgs(bits, symmetric=symmetric, strategy="group" if group else "channel", group_size=group)
    acts = None if act is None else qf.QuantArgs(8, strategy="token" if act == "dynamic" else "tensor",
                                                 dynamic=act == "dynamic")
    qconfig = qf.parse_quantization_config({"quantization_config": qf.quantization_config(weights, acts)})
    assert qconfig.format == ("pack-quantized" if act is None else "int-quantized")
    tensors = qf.write_linear("model.layers.0.mlp.up_proj", qw)
    back = qf.read_linear(tensors, "model.layers.0.mlp.up_proj", qconfig)
    assert torch.equal(back.q, qw.q)
    assert torch.equal(back.scale, qw.scale)
    assert (back.zero_point is None) == symmetric
    assert symmetric or torch.equal(back.zero_point, qw.zero_point)
    assert back.dynamic == (act == "dynamic")
    assert (back.input_scale is not None) == (act == "static")
    assert back.scheme == qw.scheme
    # compressed-tensors' own dequantization of the same integers agrees with ours
    theirs = dequantize(qw.q, qw.scale, qw.zero_point, args=QuantizationArgs(**{
        "num_bits": bits, "symmetric": symmetric, "strategy": "group" if group else "channel",
        **({"group_size": group} if group else {})}))
    assert torch.allclose(qw.dequantize(torch.float32), theirs.float(), rtol=1e-2, atol=1e-2)


def test_dequantize_matches_float64_reference():
    gen = torch.Generator().manual_seed(7)
    qw = _random_qw(gen, 4, False, 16)
    g = qw.q.shape[1] // qw.scale.shape[1]
    ref = (qw.q.double() - qw.zero_point.double().repeat_interleave(g, 1)) * qw.scale.double().repeat_interleave(g, 1)
    assert torch.allclose(qw.dequantize(torch.float64), ref, rtol=0, atol=1e-6)
    assert qw.scheme == "W4A16-group16-asym"


def test_fp8_round_trip_and_kv_scales():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(32, 64, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    qw = qf.QuantizedWeight(w, torch.rand(32, 1, generator=gen), None, 8, None, True, dynamic=True)
    cfg = {"quantization_config": qf.quantization_config(
        qf.QuantArgs(8, type="float"), qf.QuantArgs(8, type="float", strategy="token", dynamic=True),
        kv=qf.QuantArgs(8, type="float", strategy="tensor"))}
    qconfig = qf.parse_quantization_config(cfg)
    tensors = qf.write_linear("x", qw)
    tensors.update(qf.write_kv_scales("model.layers.0.self_attn", torch.tensor(0.5), torch.tensor([0.1, 0.2])))
    back = qf.read_linear(tensors, "x", qconfig)
    assert back.q.dtype == torch.float8_e4m3fn
    assert torch.equal(back.q.view(torch.uint8), w.view(torch.uint8))
    k, v = qf.read_kv_scales(tensors, "model.layers.0.self_attn", qconfig)
    assert k.tolist() == [0.5]
    assert v.shape == (2,)
    assert qf.kv_cache_dtype(qconfig) == "fp8"


def test_ignored_and_dense_modules_read_as_none_and_bad_configs_are_refused():
    qconfig = qf.parse_quantization_config({"quantization_config": qf.quantization_config(
        qf.QuantArgs(4, strategy="group", group_size=32), ignore=["lm_head", "re:.*gate_proj$"])})
    tensors = {"lm_head.weight": torch.zeros(4, 4), "model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)}
    assert qf.read_linear(tensors, "lm_head", qconfig) is None
    assert qf.read_linear(tensors, "model.layers.0.mlp.gate_proj", qconfig) is None
    assert qf.parse_quantization_config({}) is None
    with pytest.raises(LlmqError, match="quantization method 'gptq' is not supported"):
        qf.parse_quantization_config({"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(LlmqError, match="format 'marlin-24'"):
        qf.parse_quantization_config({"quantization_config": {"quant_method": "compressed-tensors",
                                                              "format": "marlin-24", "config_groups": {}}})
    with pytest.raises(LlmqError, match="weight_shape is missing"):
        qf.read_linear({"m.weight_packed": torch.zeros(2, 2, dtype=torch.int32), "m.weight_scale": torch.ones(2, 1)},
                       "m", qconfig)
