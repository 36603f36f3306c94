"""SmoothQuant W8A8 and FP8 E4M3: exact smoothing, less activation error, layers that match a float64 reference."""

import pytest
import torch

from llmq.errors import LlmqError
from llmq.models import qformat as qf
from llmq.models.arch import LLAMA
from llmq.pipeline.quantize import fp8
from llmq.pipeline.quantize import smoothquant as sq
from llmq.runtime.layers.act_quant import FP8Linear, W8A8Linear

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _outlier_acts(gen, t, k, outliers=(3, 17, 40), factor=60.0):
    x = torch.randn(t, k, generator=gen, dtype=torch.float64)
    x[:, list(outliers)] *= factor
    return x


def _ref_w8a8(x, qw):
    """float64 reference: per-token (or static) int8 activations times the dequantized int8 weight."""
    x = x.double()
    s = x.abs().amax(-1, keepdim=True) / 127 if qw.input_scale is None else qw.input_scale.double()
    xq = (x / s).round().clamp(-128, 127) * s
    return xq @ (qw.q.double() * qw.scale.double()).T


def _ref_fp8(x, qw):
    x = x.double()
    s = x.abs().amax(-1, keepdim=True) / 448 if qw.input_scale is None else qw.input_scale.double()
    xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    return xq @ (qw.q.double() * qw.scale.double()).T


@pytest.mark.parametrize("attention_bias", [False, True])
def test_smoothing_leaves_the_float_model_unchanged(tmp_path, make_tiny_model, attention_bias):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", seed=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                           attention_bias=attention_bias)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 320, (2, 24), generator=gen)
    with torch.no_grad():
        before = model(ids).logits
    cfg = model.config
    changed = 0
    for layer in model.model.layers:
        sd = {k: v for k, v in layer.state_dict().items() if "rotary" not in k}
        absmax = {n: torch.rand(sd[f"{n}.weight"].shape[1], generator=gen, dtype=torch.float64) * 10 + 0.1
                  for n in LINEARS}
        new, factors = sq.smooth_layer(sd, absmax, 0.5, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.hidden_size // cfg.num_attention_heads, LLAMA.feed_paths(),
                                       LLAMA.path("v_proj"))
        assert set(factors) == set(LINEARS)
        assert new.keys() == sd.keys()
        changed += sum(not torch.allclose(new[k], sd[k]) for k in sd)
        layer.load_state_dict(new, strict=False)
    with torch.no_grad():
        after = model(torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(11))).logits
    assert changed >= 8 * cfg.num_hidden_layers  # norms, q/k/v/o, gate/up/down all rewritten
    assert torch.allclose(after, before, rtol=0, atol=1e-10 * float(before.abs().max()))


def test_gqa_factors_are_shared_by_a_groups_query_heads():
    gen = torch.Generator().manual_seed(5)
    h, hkv, d, hidden = 6, 2, 8, 48
    sd = {"input_layernorm.weight": torch.rand(hidden, generator=gen) + 0.5,
          "post_attention_layernorm.weight": torch.rand(hidden, generator=gen) + 0.5}
    shapes = {"self_attn.q_proj": (h * d, hidden), "self_attn.k_proj": (hkv * d, hidden),
              "self_attn.v_proj": (hkv * d, hidden), "self_attn.o_proj": (hidden, h * d),
              "mlp.gate_proj": (64, hidden), "mlp.up_proj": (64, hidden), "mlp.down_proj": (hidden, 64)}
    sd |= {f"{n}.weight": torch.randn(*s, generator=gen) for n, s in shapes.items()}
    absmax = {n: torch.rand(s[1], generator=gen) + 0.1 for n, s in shapes.items()}
    _, factors = sq.smooth_layer(sd, absmax, 0.5, h, hkv, d, LLAMA.feed_paths(), LLAMA.path("v_proj"))
    s_o = factors["self_attn.o_proj"].view(hkv, h // hkv, d)
    assert torch.equal(s_o, s_o[:, :1].expand_as(s_o))
    assert not torch.allclose(s_o[0], s_o[1])


def test_smoothing_reduces_int8_activation_error_on_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 128
    x = _outlier_acts(gen, 64, k)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k ** 0.5
    ref = x @ w.T
    s = sq.smoothing_factors(x.abs().amax(0), [w], 0.5)

    def err(xx, ww):
        qw = sq.quantize_weight_int8(ww)
        y = W8A8Linear(qw.q, qw.scale, None, None, torch.float32)(xx.float()).double()
        return float((y - ref).norm() / ref.norm())

    plain, smoothed = err(x, w), err(x / s, w * s)
    assert smoothed < plain / 3, (plain, smoothed)
    assert smoothed < 0.02


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_layer_matches_float64_reference(static):
    gen = torch.Generator().manual_seed(1 + static)
    w = torch.randn(96, 160, generator=gen) * 0.05
    x = _outlier_acts(gen, 20, 160, factor=8.0).float()
    qw = sq.quantize_weight_int8(w, x.abs().amax(0) if static else None)
    assert qw.q.dtype == torch.int8
    assert qw.scale.shape == (96, 1)
    assert int(qw.q.abs().max()) == 127
    assert (qw.dequantize(torch.float64) - w.double()).abs().le(qw.scale.double() / 2 + 1e-9).all()
    assert qw.scheme == f"W8A8-channel-sym-{'static' if static else 'dynamic'}"
    # the checkpoint format round-trips it and the runtime layer computes what the reference says
    weights = qf.QuantArgs(8, strategy="channel")
    acts = qf.QuantArgs(8, strategy="tensor" if static else "token", dynamic=not static)
    qconfig = qf.parse_quantization_config({"quantization_config": qf.quantization_config(weights, acts)})
    assert qconfig.format == "int-quantized"
    back = qf.read_linear(qf.write_linear("l", qw), "l", qconfig)
    assert torch.equal(back.q, qw.q)
    assert back.dynamic == (not static)
    ref = _ref_w8a8(x, qw)
    layer = W8A8Linear(back.q, back.scale, back.input_scale, None, torch.float32)
    tol = 1e-5 * float(ref.abs().max())
    assert (layer(x).double() - ref).abs().max() < tol  # float32 matmul path: exact integer sums
    # few rows may take the CPU int8 kernel, which returns bfloat16: within its rounding (2^-8 relative)
    assert ((layer(x[:3]).double() - ref[:3]).abs() <= 2 ** -8 * ref[:3].abs() + tol).all()
    wrong = sq.quantize_weight_int8(w * 1.01, x.abs().amax(0) if static else None)
    y = W8A8Linear(qw.q, wrong.scale, back.input_scale, None, torch.float32)(x).double()
    assert (y - ref).abs().max() > 10 * tol  # a 1% scale error is far outside the tolerance
    assert float((ref - x.double() @ w.double().T).norm() / ref.norm()) < 0.05  # int8 noise, not a bug


@pytest.mark.parametrize("strategy,static", [("tensor", False), ("channel", False), ("channel", True),
                                             ("tensor", True)])
def test_fp8_round_trip_and_layer_match_float64_reference(strategy, static):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-2, 0, 64)[:, None]
    x = torch.randn(5, 96, generator=gen) * 3
    qw = fp8.quantize_weight_fp8(w, strategy, x.abs().amax(0) if static else None)
    assert qw.q.dtype == torch.float8_e4m3fn
    assert qw.scale.shape == ((1,) if strategy == "tensor" else (64, 1))
    assert float(qw.q.float().abs().max()) == 448.0
    # e4m3 keeps 3 mantissa bits: |rounding| <= 2^-4 relative, plus half the smallest subnormal step absolute
    deq = qw.dequantize(torch.float64)
    bound = w.double().abs() * 2 ** -4 + qw.scale.double() * 2 ** -10
    assert (deq - w.double()).abs().le(bound).all()
    weights = qf.QuantArgs(8, type="float", strategy=strategy)
    acts = qf.QuantArgs(8, type="float", strategy="tensor" if static else "token", dynamic=not static)
    qconfig = qf.parse_quantization_config({"quantization_config": qf.quantization_config(weights, acts)})
    assert qconfig.format == "float-quantized"
    assert qconfig.weights.strategy == strategy
    back = qf.read_linear(qf.write_linear("l", qw), "l", qconfig)
    assert torch.equal(back.q.view(torch.uint8), qw.q.view(torch.uint8))
    assert torch.equal(back.scale, qw.scale)
    y = FP8Linear(back.q, back.scale, back.input_scale, True, None, torch.float32)(x).double()
    ref = _ref_fp8(x, qw)
    tol = 1e-5 * float(ref.abs().max())
    assert (y - ref).abs().max() < tol
    y_wrong = FP8Linear(back.q, back.scale * 1.01, back.input_scale, True, None, torch.float32)(x).double()
    assert (y_wrong - ref).abs().max() > 10 * tol
    assert float((ref - x.double() @ w.double().T).norm() / ref.norm()) < 0.06


def test_bad_parameters_are_refused():
    with pytest.raises(LlmqError, match="alpha"):
        sq.smoothing_factors(torch.ones(4), [torch.ones(2, 4)], 1.5)
    with pytest.raises(LlmqError, match="per tensor or per channel"):
        fp8.quantize_weight_fp8(torch.ones(4, 4), "group")
    # dead channels (never active) keep s = 1 instead of exploding
    s = sq.smoothing_factors(torch.tensor([0.0, 4.0]), [torch.tensor([[1.0, 1.0]])], 0.5)
    assert s.tolist() == [1.0, 2.0]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("sq")
    store = Store(d / "store")
    return store, resolve_model(str(tiny_model(seed=2, attention_bias=True)), store)


@pytest.mark.parametrize("method,extra,layer_cls,scheme", [
    ("smoothquant", {}, W8A8Linear, "W8A8-channel-sym-dynamic"),
    ("fp8", {"per_tensor": True, "activations": "static"}, FP8Linear, "FP8-tensor-static")])
def test_quantize_runs_end_to_end_and_the_runtime_agrees_with_the_recorded_probe(tiny_source, method, extra,
                                                                                  layer_cls, scheme):
    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.quantize.probe import ProbeAccumulator
    from llmq.runtime import EngineConfig, LLMEngine

    store, src = tiny_source
    art = quantize(src, QuantizeOptions(bits=8, method=method, num_samples=6, seq_len=96, probe_tokens=512, **extra),
                   store, progress=False)
    assert art.config["scheme"] == scheme
    assert art.metrics["probe"]["tokens"] == 512
    ck, ck0 = CheckpointReader(art.path), CheckpointReader(src.path)
    qw = ck.linear_tensors("model.layers.0.self_attn.v_proj")[1]
    assert qw is not None
    assert qw.scheme == scheme
    assert (qw.input_scale is not None) == ("static" in scheme)
    norm, norm0 = (c.tensor("model.layers.0.input_layernorm.weight").float() for c in (ck, ck0))
    assert torch.equal(norm, norm0) != (method == "smoothquant")  # smoothing folded into the norm
    cfg = EngineConfig(kv_cache_memory=8 << 20, enable_prefix_caching=False)
    base, quant = LLMEngine(src.path, cfg), LLMEngine(art.path, cfg)
    assert any(isinstance(m, layer_cls) for m in quant.runner.model.modules())
    acc = ProbeAccumulator()
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    acc.add(base.prompt_logprobs(ids), quant.prompt_logprobs(ids))
    runtime_kld, recorded = acc.result()["kld_mean"], art.metrics["probe"]["kld_mean"]
    assert 0 < runtime_kld < 3 * recorded + 1e-4, (runtime_kld, recorded)
    assert recorded < 1e-2, (runtime_kld, recorded)
    base.shutdown()
    quant.shutdown()


def test_options_the_methods_cannot_honour_are_refused_before_any_work(tiny_source):
    from llmq.pipeline.quantize import QuantizeOptions
    from llmq.pipeline.quantize.stage import validate

    store, src = tiny_source
    before = len(store.list())
    for opts, msg in [(QuantizeOptions(bits=4, method="smoothquant"), "supports 8 bits"),
                      (QuantizeOptions(bits=8, method="fp8", group_size=32), "use --group-size 128"),
                      (QuantizeOptions(bits=8, method="smoothquant", symmetric=False), "symmetrically"),
                      (QuantizeOptions(bits=8, method="smoothquant", alpha=1.5), "alpha"),
                      (QuantizeOptions(bits=8, method="fp8", activations="sometimes"), "activation")]:
        with pytest.raises(LlmqError, match=msg):
            validate(src, opts)
    assert len(store.list()) == before
