"""`--method autoround` (issue 53, item 2): signed-gradient tuning of the rounding offsets and group scales of a whole
decoder layer. The tuned layer's output error on held-out windows against round-to-nearest's on the same grid, the
guard that keeps round-to-nearest where tuning lost, the stored integers and scales, and the method through the stage
and the runtime on tiny models."""

import pytest
import torch
from helpers import llama_layer, runtime_probe_kld

from llmq.errors import LlmqError
from llmq.models import qformat, resolve_model
from llmq.models.checkpoint import load_state_dict, read_config
from llmq.pipeline.quantize import QuantizeOptions, autoround, quantize, rtn

FAST = dict(num_samples=4, seq_len=64, probe_tokens=256)


@pytest.fixture
def tiny_source(store, tiny_model_dir):
    return resolve_model(str(tiny_model_dir), store)


def _layer_and_windows(seed: int, n: int, tokens: int = 64):
    """A random Llama decoder layer (float32) and `n` windows of correlated inputs with a few loud channels, as an LLM's
    hidden states are (with white inputs round-to-nearest is already the least-error rounding of each linear)."""
    gen = torch.Generator().manual_seed(seed)
    layer, kw = llama_layer(seed, gen, tokens)
    mix = torch.randn(16, 64, generator=gen) * (1 + 7 * (torch.arange(64) < 3))
    xs = [(torch.randn(1, tokens, 16, generator=gen) @ mix) for _ in range(n)]
    with torch.no_grad():
        refs = [layer(x, **kw) for x in xs]
    return layer, xs, [kw] * n, refs


def _grids(layer, bits, group, symmetric):
    return {n: autoround.TunedGrid.start(m.weight.data, bits, group, symmetric, torch.bfloat16, True, None)
            for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def _error(layer, grids, xs, kws, refs, tuned):
    weights = {f"{n}.weight": g.real(torch.bfloat16, tuned) for n, g in grids.items()}
    with torch.no_grad():
        return sum(float(autoround._loss(layer, weights, x, kw, r)) for x, kw, r in zip(xs, kws, refs))


@pytest.mark.parametrize("bits,group,symmetric,seed", [(4, 32, True, 0), (4, 16, False, 1), (5, 32, True, 2),
                                                       (4, 0, True, 3)])
def test_tuning_cuts_the_layers_output_error_on_held_out_windows(bits, group, symmetric, seed):
    layer, xs, kws, refs = _layer_and_windows(seed, 24)
    grids = _grids(layer, bits, group, symmetric)
    nearest_loss, tuned_loss = autoround.tune(layer, grids, xs[:16], kws[:16], refs[:16], 40, torch.bfloat16)
    assert tuned_loss < nearest_loss
    held = [xs[16:], kws[16:], refs[16:]]
    tuned, nearest = _error(layer, grids, *held, True), _error(layer, grids, *held, False)
    assert tuned < 0.8 * nearest, (tuned, nearest)
    for name, g in grids.items():
        qw = g.packed(torch.bfloat16, True)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        assert lo <= int(qw.q.min())
        assert int(qw.q.max()) <= hi
        assert qw.scale.dtype == torch.bfloat16
        assert (qw.zero_point is None) == symmetric
        assert torch.equal(qw.dequantize(torch.float32), g.real(torch.bfloat16, True)), name
        assert float((g.v.detach().abs() > 0).float().mean()) > 0.5    # the offsets moved
        assert float(g.v.detach().abs().max()) <= 0.5


def test_a_layer_keeps_round_to_nearest_where_tuning_lost():
    """One step at lr 1 pushes every offset to +-0.5: a worse layer, so round-to-nearest's grid is stored (and the
    manifest says so)."""
    layer, xs, kws, refs = _layer_and_windows(4, 8)
    grids = _grids(layer, 4, 32, True)
    nearest_loss, tuned_loss = autoround.tune(layer, grids, xs, kws, refs, 1, torch.bfloat16)
    assert tuned_loss > nearest_loss
    w = layer.mlp.down_proj.weight.data
    plain = rtn.quantize_weight(w, 4, 32, True, torch.bfloat16, search=True)
    stored = grids["mlp.down_proj"].packed(torch.bfloat16, False)
    assert torch.equal(stored.q, plain.q)
    assert torch.equal(stored.scale, plain.scale)
    assert all(p.requires_grad for p in layer.parameters())   # the layer's own parameters as they were


@pytest.mark.parametrize("opts,match", [
    (dict(bits=4, method="gptq", iters=5), "--iters is AutoRound's"),
    (dict(bits=4, method="autoround", per_tensor=True), "per tensor"),
    (dict(method="autoround", grid="q4_k"), "--grid q4_k is 4-bit rtn or gptq"),
    (dict(bits=4, method="autoround", iters=0), "iters")])
def test_bad_autoround_options_are_refused_before_any_work(store, tiny_source, opts, match):
    with pytest.raises(LlmqError, match=match):
        quantize(tiny_source, QuantizeOptions(**opts), store, progress=False)
    assert store.list(kind="quantized") == []


@pytest.mark.parametrize("symmetric", [True, False])
def test_autoround_checkpoint_runs_in_the_runtime_as_probed(store, tiny_source, symmetric):
    """The stage writes a compressed-tensors checkpoint whose linears differ from round-to-nearest's, and the
    runtime's KLD on the probe's tokens is the probe's (the layers it ran are the stored ones)."""
    art = quantize(tiny_source, QuantizeOptions(bits=4, method="autoround", iters=20, symmetric=symmetric,
                                                group_size=16, **FAST), store, progress=False)
    plain = quantize(tiny_source, QuantizeOptions(bits=4, method="rtn", symmetric=symmetric, group_size=16, **FAST),
                     store, progress=False)
    qc = qformat.parse_quantization_config(read_config(art.path))
    assert qc.weights.num_bits == 4
    assert qc.weights.group_size == 16
    assert qc.weights.symmetric == symmetric
    assert art.config["method"] == "autoround"
    assert art.config["options"]["iters"] == 20
    a, b = load_state_dict(art.path), load_state_dict(plain.path)
    name = "model.layers.1.mlp.down_proj"
    qa, qb = qformat.read_linear(a, name, qc), qformat.read_linear(b, name, qc)
    assert not torch.equal(qa.q, qb.q)
    assert all(r["tuned"] and r["loss_tuned"] < r["loss_nearest"] for r in art.config["method_layers"])
    recorded = art.metrics["probe"]["kld_mean"]
    assert abs(runtime_probe_kld(tiny_source.path, art.path, FAST["probe_tokens"]) / recorded - 1) < 1e-3


def test_each_layer_aims_at_the_float_models_own_states(store, tiny_source, monkeypatch):
    """The targets of layer 1 are the float layer 1 on the float model's states (layer 0's float output), not on the
    quantized stream's: each layer is tuned toward what the unquantized model computes."""
    from transformers import AutoModelForCausalLM

    seen = []
    real_tune = autoround.tune
    monkeypatch.setattr(autoround, "tune", lambda layer, grids, inputs, kwargs, refs, *a, **k: (
        seen.append((inputs, kwargs, refs)), real_tune(layer, grids, inputs, kwargs, refs, *a, **k))[1])
    quantize(tiny_source, QuantizeOptions(bits=4, method="autoround", iters=3, group_size=16, **FAST), store,
             progress=False)
    (_, _, f0), (x1, kw1, f1) = seen[:2]
    assert not torch.allclose(x1[0], f0[0])       # the quantized stream has moved off the float one
    hf = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float32).eval()
    with torch.no_grad():
        for f, x, kw, target in zip(f0, x1, kw1, f1):
            assert torch.allclose(hf.model.layers[1](f, **kw), target, atol=1e-5)
            assert not torch.allclose(hf.model.layers[1](x, **kw), target, atol=1e-5)


def test_the_stage_stores_round_to_nearest_where_tuning_lost_and_says_so(store, tiny_source, monkeypatch):
    """--iters 1 (lr 1: every offset to +-0.5) loses in every layer: the checkpoint is the one whose tuning never
    moved (round-to-nearest's grid), and the manifest records both losses of each layer."""
    opts = dict(bits=4, method="autoround", iters=1, group_size=16, **FAST)
    lost = quantize(tiny_source, QuantizeOptions(**opts), store, progress=False)
    layers = lost.config["method_layers"]
    assert len(layers) == 2
    assert all(not r["tuned"] and r["loss_tuned"] > r["loss_nearest"] > 0 for r in layers)
    monkeypatch.setattr(autoround.TunedGrid, "step", lambda self, lr: None)
    still = quantize(tiny_source, QuantizeOptions(**opts, name="still"), store, progress=False)
    qc = qformat.parse_quantization_config(read_config(lost.path))
    a, b = load_state_dict(lost.path), load_state_dict(still.path)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(qformat.read_linear(a, name, qc).q, qformat.read_linear(b, name, qc).q)
