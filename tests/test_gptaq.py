"""GPTQ `--gptaq` (GPTAQ's asymmetric calibration): the weight GPTQ rounds is first moved to the least-squares map
from the quantized model's inputs of a linear to the float model's outputs of it. The map against a float64 least
squares, GPTQ unchanged where the two streams agree, a decoder layer's error against the float layer on held-out
windows below plain GPTQ's, the engine's pairing of the two streams, and the refusals."""

import pytest
import torch
from helpers import llama_layer

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.checkpoint import load_state_dict
from llmq.pipeline.quantize import QuantizeOptions, gptq, quantize
from llmq.pipeline.quantize.layerwise import LayerContext

FAST = dict(num_samples=4, seq_len=64, probe_tokens=256)


def _streams(gen, n: int, tokens: int, width: int, drift: float, noise: float):
    """`n` windows of the float model's states (correlated, a few loud channels) and the quantized model's at the
    same positions: the float ones turned by a small random map plus noise, as rounding upstream moves them."""
    mix = torch.randn(16, width, generator=gen) * (1 + 7 * (torch.arange(width) < 3))
    turn = torch.eye(width) + drift * torch.randn(width, width, generator=gen) / width ** 0.5
    xf = [torch.randn(1, tokens, 16, generator=gen) @ mix for _ in range(n)]
    xq = [x @ turn + noise * torch.randn(x.shape, generator=gen) for x in xf]
    return xf, xq


def test_the_target_is_the_least_squares_map_from_quantized_inputs_to_float_outputs():
    gen = torch.Generator().manual_seed(0)
    xf, xq = (torch.cat(s)[0] for s in _streams(gen, 8, 64, 48, 0.3, 0.3))
    w = torch.randn(24, 48, generator=gen)
    n = xq.shape[0]
    h, c = 2 / n * xq.T @ xq, 2 / n * (xf - xq).T @ xq
    got = gptq.asymmetric_target(w, h, c, damp=1e-9)
    want = torch.linalg.lstsq(xq.double(), xf.double() @ w.double().T).solution.T
    moved = float((want - w.double()).norm())
    assert moved > 0.1 * float(w.norm())        # the map is far from W: the test can see a wrong one
    assert float((got.double() - want).norm()) < 2e-3 * moved   # a float32 solve; H's condition number is ~1e6
    assert torch.equal(gptq.asymmetric_target(w, h, torch.zeros_like(h), 0.01), w)  # streams agree: W itself


def _layer_context(layer, xq, xf, kws, **opts):
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    return LayerContext(0, "model.layers.0", layer, linears, QuantizeOptions(method="gptq", **opts), None,
                        torch.bfloat16, torch.device("cpu"), xq, kws, float_inputs=xf)


@pytest.mark.parametrize("bits,group,act_order,seed", [(4, 32, True, 0), (4, 16, False, 1), (5, 32, True, 2)])
def test_a_layer_aimed_at_the_float_model_misses_its_output_by_less_on_held_out_windows(bits, group, act_order, seed):
    """The quantized layer fed the quantized stream against the float layer fed the float one (residual excluded:
    no weight can correct it), on 8 windows neither GPTQ saw."""
    gen = torch.Generator().manual_seed(seed)
    layer, kw = llama_layer(seed, gen, 64)
    xf, xq = _streams(gen, 24, 64, 64, 0.15, 0.02)
    kws = [kw] * 24
    with torch.no_grad():
        refs = [layer(x, **kw) - x for x, kw in zip(xf, kws)]    # the float layer's update of the float stream
    weights = {n: m.weight.data.clone() for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    errors = {}
    for aimed in (False, True):
        for name, m in layer.named_modules():
            if name in weights:
                m.weight.data = weights[name].clone()
        qws = gptq.quantize_layer(_layer_context(layer, xq[:16], xf[:16], kws[:16], bits=bits, group_size=group,
                                                 act_order=act_order, gptaq=aimed))
        for name, m in layer.named_modules():
            if name in qws:
                m.weight.data = qws[name].dequantize(torch.float32)
        with torch.no_grad():
            errors[aimed] = sum(float((layer(x, **kw) - x - r).pow(2).sum())
                                for x, kw, r in zip(xq[16:], kws[16:], refs[16:]))
    # the drift is mostly linear, so most of the error goes; the bar also fails the two wrong versions: all linears
    # aimed at once against the layer's float weights, and stages whose float side ran the rounded weights
    assert errors[True] < 0.2 * errors[False], errors


def test_a_layers_linears_go_in_stages_each_measured_after_the_ones_before_it_are_rounded():
    """q / k / v (one input), then o, then gate / up, then down; a stage's Hessian comes from the layer with the
    stages before it rounded, and its float side from the float weights (put back after)."""
    gen = torch.Generator().manual_seed(5)
    layer, kw = llama_layer(5, gen, 32)
    xf, xq = _streams(gen, 4, 32, 64, 0.15, 0.02)
    kws = [kw] * 4
    ctx = _layer_context(layer, xq, xf, kws, bits=4, group_size=32, gptaq=True)
    stages = gptq._stages(ctx.hessians(list(ctx.linears), float_inputs=True)[0])
    assert stages == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                      ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    float_o = layer.self_attn.o_proj.weight.data.clone()
    seen = []
    real = LayerContext.hessians
    ctx.hessians = lambda names, float_inputs=False: (
        seen.append((list(names), {n: ctx.linears[n].weight.data.clone() for n in ctx.float_weights})),
        real(ctx, names, float_inputs))[1]
    qws = gptq.quantize_layer(ctx)
    assert [names for names, _ in seen] == [list(ctx.linears), *stages[1:]]
    assert set(seen[2][1]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert torch.equal(seen[2][1]["self_attn.o_proj"], qws["self_attn.o_proj"].dequantize(torch.float32))
    assert not torch.equal(float_o, seen[2][1]["self_attn.o_proj"])
    assert ctx.float_weights == {}


@pytest.fixture
def tiny_source(store, tiny_model_dir):
    return resolve_model(str(tiny_model_dir), store)


def test_the_engine_pairs_each_layer_with_the_float_models_inputs(store, tiny_source, monkeypatch):
    """Layer 0 sees the same states on both sides (the 16-bit table), so its first stage is plain GPTQ's bit for bit;
    layer 1's float inputs are the float layer 0's output, not the quantized stream's, and its weights differ."""
    seen = []
    real = LayerContext.hessians
    monkeypatch.setattr(LayerContext, "hessians", lambda self, names, float_inputs=False: (
        seen.append((self.index, self.calib_inputs, self.float_inputs)), real(self, names, float_inputs))[1])
    aimed = quantize(tiny_source, QuantizeOptions(method="gptq", bits=4, group_size=16, gptaq=True, **FAST), store,
                     progress=False)
    firsts = {i: (x, f) for i, x, f in reversed(seen)}   # each layer's first pass (its stages run more)
    (x0, f0), (x1, f1) = firsts[0], firsts[1]
    assert all(torch.equal(a, b) for a, b in zip(x0, f0, strict=True))
    assert not torch.allclose(x1[0], f1[0])
    seen.clear()
    plain = quantize(tiny_source, QuantizeOptions(method="gptq", bits=4, group_size=16, **FAST), store,
                     progress=False)
    assert seen
    assert all(f == [] for _, _, f in seen)     # plain GPTQ carries no float stream
    assert aimed.config["options"]["gptaq"] is True
    assert aimed.name != plain.name
    a, b = load_state_dict(aimed.path), load_state_dict(plain.path)
    # layer 0's first stage: the same Hessian and no asymmetry (its later stages see the rounded ones before them)
    assert torch.equal(a["model.layers.0.self_attn.q_proj.weight_packed"],
                       b["model.layers.0.self_attn.q_proj.weight_packed"])
    assert not torch.equal(a["model.layers.1.mlp.down_proj.weight_packed"],
                           b["model.layers.1.mlp.down_proj.weight_packed"])


@pytest.mark.parametrize("opts,match", [
    (dict(method="rtn", bits=4, gptaq=True), "--act-order / --gptaq are GPTQ options"),
    (dict(method="nvfp4", gptq=True, gptaq=True), "--gptaq is integer GPTQ's")])
def test_gptaq_elsewhere_is_refused_before_any_work(store, tiny_source, opts, match):
    with pytest.raises(LlmqError, match=match):
        quantize(tiny_source, QuantizeOptions(**opts), store, progress=False)
    assert store.list(kind="quantized") == []
