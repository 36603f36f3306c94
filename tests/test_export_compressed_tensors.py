"""Contract tests: what `llmq quantize` / `llmq quantize-kv` write is the compressed-tensors format, and llmq's runtime
computes what that format means.

The format's expectations are data (EXPECT below: the tensors of every quantized linear with their dtypes and
shapes, and the config fields). The reader they are checked against is transformers' loader: compressed-tensors
decompresses the weights and runs its own forward (activations fake-quantized per token or with `input_scale`, K / V
fake-quantized with `k_scale` / `v_scale` as they enter the cache), the reference semantics that vLLM and SGLang
implement with kernels. Every scheme is written from a tiny random bf16 model, loaded by transformers in float32 and
by llmq's runtime, and compared twice:
- each quantized linear on the very activations transformers feeds it: equal to float32 rounding;
- the whole model's next-token distributions: KLD at float32-rounding level.
Where transformers' loader cannot read a scheme, compressed-tensors' own decompressor is the reader: asymmetric
pack-quantized weights (INT4 with zero points). compressed-tensors writes their `weight_zero_point` packed along the
outputs, [out / 8, groups] int32 (and so does llmq, and so vLLM reads it), but transformers 5.x sets the model up on
the meta device, where compressed-tensors leaves the zero point unpacked ([out, groups]), and then refuses the
checkpoint's shape; its `dequantize=True` route reads it but rounds the weights to the bf16 scale dtype. vLLM itself
is not installed here (it needs a GPU build): its side is represented by its kernels' documented arithmetic
(`llmq.quant`).

Two known, documented differences are isolated rather than hidden:
- dynamic int8 activations: compressed-tensors' reference scale is max|x| / 127.5, vLLM's and SGLang's kernels (and
  llmq) use max|x| / 127. The W8A8 test shows the mismatch, then gives transformers the engines' scale and asserts that
  nothing else differs.
- llmq's INT4 CPU kernel takes bfloat16 activations: the exact comparison switches it off; it is the fast path, so the
  quantize probe measures it (tested below).
Activation-quantized models are discontinuous in their inputs: a float32 rounding difference that moves one activation
across a rounding boundary changes every later layer. On SmolLM2-135M a 1e-7 relative perturbation of the embeddings
alone moves transformers' own W8A8 / FP8 model by KLD 0.011-0.015, so two correct implementations differ that much
there; on a 2-layer model such flips stay rare, which is why the end-to-end check uses one.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import bf16_kernels_off, hf_model, runtime_logprobs, runtime_probe_kld

from llmq.models import qformat
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize.probe import kld_top1

LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
           "mlp.down_proj": (64, 128)}  # [out, in] of the tiny model's linears (hidden 64, 4 heads / 2 KV heads)
# Phi-3 stores q/k/v and gate/up fused, and so does its quantized checkpoint: the names transformers and vLLM load
FUSED_LINEARS = {"phi3": {"self_attn.qkv_proj": (128, 64), "self_attn.o_proj": (64, 64),
                          "mlp.gate_up_proj": (256, 64), "mlp.down_proj": (64, 128)}}
KV_HEADS = 2
PROBE_TOKENS = 256


def _int4(group):
    return {"weight_packed": (torch.int32, lambda n, k: (n, k // 8)),
            "weight_scale": (torch.bfloat16, lambda n, k: (n, k // group)),
            "weight_shape": (torch.int64, lambda n, k: (2,))}


PACKED_INT8 = {"weight_packed": (torch.int32, lambda n, k: (n, k // 4)),
               "weight_scale": (torch.bfloat16, lambda n, k: (n, 1)),
               "weight_shape": (torch.int64, lambda n, k: (2,))}
INT4_ASYM = {**_int4(32), "weight_zero_point": (torch.int32, lambda n, k: (n // 8, k // 32))}
W8A8 = {"weight": (torch.int8, lambda n, k: (n, k)), "weight_scale": (torch.bfloat16, lambda n, k: (n, 1))}
STATIC = {"input_scale": (torch.float32, lambda n, k: (1,))}
FP8 = {"weight": (torch.float8_e4m3fn, lambda n, k: (n, k)), "weight_scale": (torch.bfloat16, lambda n, k: (n, 1))}
FP8_TENSOR = {"weight": (torch.float8_e4m3fn, lambda n, k: (n, k)),
              "weight_scale": (torch.bfloat16, lambda n, k: (1,)), **STATIC}


def _args(bits, type="int", strategy="channel", group_size=None, symmetric=True, dynamic=False):
    d = {"num_bits": bits, "type": type, "symmetric": symmetric, "strategy": strategy, "dynamic": dynamic}
    return d if group_size is None else {**d, "group_size": group_size}


INT4_G32 = _args(4, strategy="group", group_size=32)
INT8_CH = _args(8)
TOKEN_INT8 = _args(8, strategy="token", dynamic=True)
TOKEN_FP8 = _args(8, type="float", strategy="token", dynamic=True)
# name: (quantize options, format, weights args, input-activation args, tensors of each linear)
EXPECT = {
    "rtn-w4g32": (dict(method="rtn", bits=4, group_size=32), "pack-quantized", INT4_G32, None, _int4(32)),
    "rtn-w4g32-asym": (dict(method="rtn", bits=4, group_size=32, symmetric=False), "pack-quantized",
                       {**INT4_G32, "symmetric": False}, None, INT4_ASYM),
    "gptq-w4g32": (dict(method="gptq", bits=4, group_size=32), "pack-quantized", INT4_G32, None, _int4(32)),
    "awq-w4g32": (dict(method="awq", bits=4, group_size=32), "pack-quantized", INT4_G32, None, _int4(32)),
    "rtn-w8": (dict(method="rtn", bits=8), "pack-quantized", INT8_CH, None, PACKED_INT8),
    "gptq-w8": (dict(method="gptq", bits=8), "pack-quantized", INT8_CH, None, PACKED_INT8),
    "smoothquant": (dict(method="smoothquant", bits=8), "int-quantized", INT8_CH, TOKEN_INT8, W8A8),
    "smoothquant-static": (dict(method="smoothquant", bits=8, activations="static"), "int-quantized", INT8_CH,
                           _args(8, strategy="tensor"), {**W8A8, **STATIC}),
    "fp8": (dict(method="fp8", bits=8), "float-quantized", _args(8, type="float"), TOKEN_FP8, FP8),
    "fp8-static-tensor": (dict(method="fp8", bits=8, activations="static", per_tensor=True), "float-quantized",
                          _args(8, type="float", strategy="tensor"), _args(8, type="float", strategy="tensor"),
                          FP8_TENSOR),
}
QUANTIZE = {name: e[0] for name, e in EXPECT.items()}  # the `quantized` fixture's (conftest) artifacts
# kv type, granularity -> kv_cache_scheme and the shape of every k_scale / v_scale
KV_EXPECT = {("int8", "tensor"): (_args(8, strategy="tensor"), (1,)),
             ("int8", "head"): (_args(8, strategy="attn_head"), (KV_HEADS, 1, 1)),
             ("fp8", "tensor"): (_args(8, type="float", strategy="tensor"), (1,)),
             ("fp8", "head"): (_args(8, type="float", strategy="attn_head"), (KV_HEADS, 1, 1))}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3_text", "phi3", "smollm3"])
def source(tmp_path_factory, request, tiny_model):
    """A tiny random model of each family stored in bf16 (as real checkpoints are, so scales are bf16), as a model
    artifact (Qwen3: the same shapes, with its per-head q/k norms; Phi-3: the same, stored fused; SmolLM3: its second
    layer without the rotary embedding)."""

    from llmq.artifacts import Store
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("ct")
    nope = {"no_rope_layers": [1, 0]} if request.param == "smollm3" else {}
    path = tiny_model(seed=5, bf16=True, model_type=request.param, head_dim=16, **nope)
    store = Store(d / "store")
    return store, resolve_model(str(path), store)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(11))


def _transformers(path):
    """transformers' model of a checkpoint in float32, after one forward (compressed-tensors decompresses then)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = hf_model(path)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return model


def _decompressed(art, source):
    """The source model in float32 with each quantized linear's weight as compressed-tensors' own decompressor reads
    it from the checkpoint (scales in float32, so nothing is rounded on the way)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoModelForCausalLM

    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    (group,) = cfg["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    model = AutoModelForCausalLM.from_pretrained(source[1].path, dtype=torch.float32).eval()
    for i in range(2):
        for name in _linears(art):
            prefix = f"model.layers.{i}.{name}"
            stored = {k[len(prefix) + 1:]: ck.tensors[k] for k in ck.tensors if k.startswith(prefix + ".")}
            stored["weight_scale"] = stored["weight_scale"].float()
            model.get_submodule(prefix).weight.data = compressor.decompress(stored, scheme)["weight"].float()
    return model


def _check_format(art, fmt, weights, acts, tensors):
    import compressed_tensors

    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    assert cfg["format"] == fmt
    assert cfg["quantization_status"] == "compressed"
    assert cfg["ignore"] == ["lm_head"]
    assert cfg["version"] == compressed_tensors.__version__
    (group,) = cfg["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["weights"] == weights
    assert group.get("input_activations") == acts
    stored = ck.tensors
    for i in range(2):
        for name, (n, k) in _linears(art).items():
            prefix = f"model.layers.{i}.{name}."
            have = {key[len(prefix):]: stored[key] for key in stored if key.startswith(prefix)}
            assert set(have) == set(tensors), (prefix, sorted(have))
            for key, (dtype, shape) in tensors.items():
                assert have[key].dtype == dtype, (prefix + key, have[key])
                assert tuple(have[key].shape) == shape(n, k), (prefix + key, have[key])
    assert stored["lm_head.weight"].dtype == torch.bfloat16  # ignored: stays dense


def _linear_gaps(art, hf, ids) -> dict[str, float]:
    """Per quantized linear: max |llmq's runtime layer - transformers' linear| / max |output|, on the inputs
    transformers' own forward feeds that linear."""
    from llmq.runtime.loader import quantized_linear

    seen = {}
    hooks = [m.register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, (a[0][0], out[0])))
             for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    ck = CheckpointReader(art.path)
    gaps = {}
    for name, (x, y) in seen.items():
        _, qw, bias = ck.linear_tensors(name)
        layer = quantized_linear(qw, bias, torch.float32, "cpu")
        with torch.no_grad():
            gaps[name] = float((layer(x) - y).abs().max() / y.abs().max())
    return gaps


@pytest.mark.parametrize("name", [n for n, e in EXPECT.items() if e[3] is None])
def test_weight_only_schemes_match_transformers(source, quantized, ids, name, monkeypatch):
    opts, fmt, weights, acts, tensors = EXPECT[name]
    art = quantized(name)
    _check_format(art, fmt, weights, acts, tensors)
    bf16_kernels_off(monkeypatch)
    hf = _transformers(art.path) if weights["symmetric"] else _decompressed(art, source)
    assert max(_linear_gaps(art, hf, ids).values()) < 1e-5
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = kld_top1(ref, runtime_logprobs(art.path, ids[0].tolist()))
    assert got["kld_mean"] < 1e-8, got
    assert got["top1"] == 1.0, got


def _engines_int8_token_scale(monkeypatch):
    """Give compressed-tensors' forward the engines' dynamic int8 scale, max|x| / 127 per token."""
    from compressed_tensors.quantization.lifecycle import forward

    theirs = forward.compute_dynamic_scales_and_zp

    def engines(value, args, module, global_scale=None):
        scale, zero = theirs(value, args, module, global_scale=global_scale)
        if args.type == "int":
            scale = value.abs().amax(-1, keepdim=True).to(scale.dtype) / 127
        return scale, zero

    monkeypatch.setattr(forward, "compute_dynamic_scales_and_zp", engines)


@pytest.mark.parametrize("name", [n for n, e in EXPECT.items() if e[3] is not None])
def test_activation_quantized_schemes_match_transformers(quantized, ids, name, monkeypatch):
    opts, fmt, weights, acts, tensors = EXPECT[name]
    art = quantized(name)
    _check_format(art, fmt, weights, acts, tensors)
    hf = _transformers(art.path)
    if acts == TOKEN_INT8:  # the one documented difference: transformers' dynamic int8 scale is max|x| / 127.5
        assert min(_linear_gaps(art, hf, ids).values()) > 1e-3
        _engines_int8_token_scale(monkeypatch)
    assert max(_linear_gaps(art, hf, ids).values()) < 1e-5
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = kld_top1(ref, runtime_logprobs(art.path, ids[0].tolist()))
    # float32 rounding, amplified where it flips a quantized activation: on the Gemma model (embeddings scaled by
    # sqrt(hidden), four norms a layer) FP8 flips moved it 1.9e-4; the scheme itself costs this model ~2.5e-3
    bound = 1e-3 if _family(quantized(name)) == "gemma3_text" and name.startswith("fp8") else 1e-4
    assert got["kld_mean"] < bound, got


@pytest.mark.parametrize("name", ["rtn-w4g32", "smoothquant", "fp8"])
def test_the_quantize_probe_measures_what_the_runtime_computes(source, quantized, name, monkeypatch):
    """The probe recorded by `llmq quantize` (KLD of the quantized model vs the source on held-out windows) equals
    the runtime's own, kernels included: for INT4, the bf16-activation kernel's share of the KLD is in the record."""
    art, src = quantized(name), source[1]

    def runtime_kld():
        return runtime_probe_kld(src.path, art.path, PROBE_TOKENS)

    recorded = art.metrics["probe"]["kld_mean"]
    # Qwen3's fp8 model: the probe runs transformers' q/k norms, the runtime its own (float32 rounding apart); one
    # FP8 activation rounded the other way moved the KLD by 1.1e-5 relative here, still 100x under the >1e-3 of a
    # probe that measured different arithmetic (below). Phi-3's: every position agrees to 2.4e-7 but one (249 of
    # 256), where an FP8 activation rounds the other way after transformers' attention and the runtime's: 1.6e-4.
    # Qwen3's W8A8 (calibrated on the chat / prose / code mix): the per-position KLDs agree to a median 1.8e-9, but
    # one INT8 activation at position 121 of 256 rounds the other way and 16 later positions attending to it move
    # (up to 5.7e-5): 2.1e-3 relative. INT4 with searched scales: the bf16-activation kernel rounds its inputs to
    # bfloat16, and a float32 difference between the probe's transformers layers and the runtime's moves an input
    # across a bfloat16 rounding boundary here and there: 5.0e-5 relative on the Llama model. SmolLM3's fp8: 3.5e-4,
    # FP8 activations rounding the other way as Phi-3's (its RTN / GPTQ / AWQ / INT8 probes agree to 1e-5)
    flips = {("qwen3", "fp8"): 1e-4, ("phi3", "fp8"): 3e-4, ("smollm3", "fp8"): 5e-4,
             ("qwen3", "smoothquant"): 3e-3}.get(
        (_family(src), name), 1e-4 if name == "rtn-w4g32" else 1e-5)
    assert abs(runtime_kld() / recorded - 1) < flips
    if name == "rtn-w4g32":
        bf16_kernels_off(monkeypatch)
        assert abs(runtime_kld() / recorded - 1) > 1e-3  # exact arithmetic is measurably not what was recorded


@pytest.mark.parametrize("kv,granularity", list(KV_EXPECT))
def test_kv_cache_schemes_match_transformers(source, ids, kv, granularity):
    from llmq.pipeline.kvcache import KVOptions, quantize_kv

    scheme, shape = KV_EXPECT[kv, granularity]
    store, src = source
    art = quantize_kv(src, store, KVOptions(kv=kv, granularity=granularity, num_samples=4, seq_len=64,
                                            probe_tokens=128), show_progress=False)
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    assert cfg["format"] == "dense"
    assert cfg["config_groups"] == {}
    assert cfg["kv_cache_scheme"] == scheme
    for i in range(2):
        for s in ("k_scale", "v_scale"):
            t = ck.tensors[f"model.layers.{i}.self_attn.{s}"]
            assert t.dtype == torch.float32
            assert tuple(t.shape) == shape
            assert bool((t > 0).all())
    hf = _transformers(art.path)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = kld_top1(ref, runtime_logprobs(art.path, ids[0].tolist()))
    # float32 op orders that differ from transformers' move a K / V value across an FP8 / INT8 step now and then:
    # Gemma 3's four (1 + w) norms a layer (1.6e-7 measured), a product on AMX (three bfloat16 parts of x summed in
    # the tile unit: 1.5e-8 on Qwen 3, FP8 per tensor, on a Xeon); far under what the cache's rounding costs
    bound = 1e-6 if _family(src) == "gemma3_text" else 1e-7
    assert art.metrics["probe"]["kld_mean"] > 10 * bound
    assert got["kld_mean"] < bound, got
    assert got["top1"] == 1.0, got


def _family(src) -> str:
    from llmq.models.checkpoint import read_config

    return read_config(src.path)["model_type"]


def _linears(art) -> dict[str, tuple[int, int]]:
    return FUSED_LINEARS.get(_family(art), LINEARS)


def test_a_checkpoint_from_a_newer_format_is_refused_in_one_line():
    from llmq.errors import LlmqError

    cfg = qformat.quantization_config(qformat.QuantArgs(8))
    assert qformat.parse_quantization_config({"quantization_config": cfg}).format == "pack-quantized"
    newer = {**cfg, "version": f"{qformat.CT_MAX[0]}.{qformat.CT_MAX[1]}.0"}
    with pytest.raises(LlmqError, match=r"newer format than llmq reads \(" + re.escape(qformat.CT_REQUIREMENT) + r"\)"):
        qformat.parse_quantization_config({"quantization_config": newer})
    older = {**cfg, "version": "0.9.4"}  # llm-compressor checkpoints of older releases read as before
    assert qformat.parse_quantization_config({"quantization_config": older}).weights.num_bits == 8


def test_pyproject_pins_the_compressed_tensors_range_llmq_reads():
    from pathlib import Path

    import tomllib

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert qformat.CT_REQUIREMENT in deps


def test_an_installed_compressed_tensors_outside_the_range_is_a_clear_error(monkeypatch):
    import compressed_tensors

    from llmq.errors import LlmqError

    monkeypatch.setattr(compressed_tensors, "__version__", "0.16.2")
    with pytest.raises(LlmqError, match=r"compressed-tensors 0\.16\.2 is installed but llmq writes the format of"):
        qformat.quantization_config(qformat.QuantArgs(8))


def _assert_transformers_computes_what_llmq_computes(art, ids, monkeypatch):
    bf16_kernels_off(monkeypatch)
    hf = _transformers(art.path)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = kld_top1(ref, runtime_logprobs(art.path, ids[0].tolist()))
    assert got["kld_mean"] < 1e-8, got
    assert got["top1"] == 1.0, got


@pytest.mark.parametrize("tied", [False, True])
def test_an_int8_lm_head_is_a_second_group_that_transformers_loads_and_llmq_computes(tmp_path, ids, tied,
                                                                                      monkeypatch):
    """`--lm-head int8`: the output projection is a weight-only INT8 per-channel group of its own (a tied model is
    untied, its embedding table kept 16-bit for the lookup); transformers computes what llmq computes, and the
    probe counts the head's rounding."""
    from helpers import make_tiny_model
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    path = make_tiny_model(tmp_path / "tiny", seed=7, tie_word_embeddings=tied)
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    store = Store(tmp_path / "store")
    src = resolve_model(str(path), store)
    common = dict(method="rtn", bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=PROBE_TOKENS)
    art = quantize(src, QuantizeOptions(lm_head="int8", **common), store, progress=False)
    plain = quantize(src, QuantizeOptions(**common), store, progress=False)

    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    groups = {tuple(g["targets"]): g for g in cfg["config_groups"].values()}
    assert set(groups) == {("Linear",), ("lm_head",)}
    assert cfg["ignore"] == []
    assert groups[("Linear",)]["weights"] == INT4_G32
    assert groups[("lm_head",)]["weights"] == INT8_CH
    assert ck.config["tie_word_embeddings"] is False
    assert art.config["scheme_per_module"]["lm_head"] == "W8A16-channel-sym"
    vocab, hidden = ck.tensors["model.embed_tokens.weight"].shape
    assert ck.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" not in ck.tensors
    for key, (dtype, shape) in PACKED_INT8.items():
        t = ck.tensors[f"lm_head.{key}"]
        assert t.dtype == dtype, key
        assert tuple(t.shape) == shape(vocab, hidden), key
    assert ck.linear("lm_head").qw.bits == 8

    _assert_transformers_computes_what_llmq_computes(art, ids, monkeypatch)
    # the head's rounding is in the probe: it differs from the same layers with a 16-bit head
    assert art.metrics["probe"]["kld_mean"] != plain.metrics["probe"]["kld_mean"]


@pytest.mark.parametrize("method, target, chosen", [("rtn", 6, {4, 8}), ("gptq", 10, {8, 16})])
def test_mixed_precision_is_named_groups_that_transformers_loads_and_llmq_computes(source, ids, method, target, chosen,
                                                                                   monkeypatch):
    """`--target-bpw`: the most common scheme targets `Linear`, every other is a weight-only group naming its modules
    (16-bit ones in `ignore`); the stored widths are the manifest's, the linears fit the budget, and transformers
    computes what llmq computes."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    art = quantize(src, QuantizeOptions(method=method, bits=4, group_size=32, target_bpw=target, num_samples=4,
                                        seq_len=64, probe_tokens=PROBE_TOKENS), store, progress=False)
    mixed = art.config["mixed_precision"]
    widths = {f"model.layers.{u['layer']}.{m}": u["bits"] for u in mixed["units"] for m in u["modules"]}
    assert len(widths) == 2 * len(_linears(src)), widths
    assert set(widths.values()) == chosen, widths
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    groups = {tuple(g["targets"]): g["weights"] for g in cfg["config_groups"].values()}
    named = {m: args for targets, args in groups.items() if targets != ("Linear",) for m in targets}
    for name, bits in widths.items():
        if bits == 16:
            assert name in cfg["ignore"], name
            assert name not in named, name
        else:
            assert named.get(name, groups[("Linear",)]) == {4: INT4_G32, 8: INT8_CH}[bits], name
    assert cfg["ignore"] == ["lm_head", *sorted(n for n, b in widths.items() if b == 16)]
    for name, bits in widths.items():
        qw = ck.linear(name).qw
        assert (qw.bits if qw is not None else 16) == bits, name
        per_module = art.config["scheme_per_module"]
        assert per_module.get(name, per_module["Linear"]) == {4: "W4A16-group32-sym", 8: "W8A16-channel-sym",
                                                              16: "dense"}[bits]
    params = sum(n * k for n, k in _linears(src).values()) * 2
    assert art.metrics["linear_bytes"] <= mixed["budget_bytes"] == target * params // 8
    dense_bytes = sum(2 * ck.tensors[f"{n}.weight"].numel() for n, b in widths.items() if b == 16)
    quantized = sum(1 for b in widths.values() if b != 16)  # the plan counts all but each one's 16-byte weight_shape
    assert art.metrics["linear_bytes"] + dense_bytes - mixed["bytes"] == 16 * quantized

    _assert_transformers_computes_what_llmq_computes(art, ids, monkeypatch)


def test_an_int8_lm_head_needs_a_weight_only_method():
    from llmq.errors import LlmqError
    from llmq.pipeline.quantize import QuantizeOptions

    with pytest.raises(LlmqError, match="--lm-head int8 needs a weight-only method"):
        QuantizeOptions(method="smoothquant", bits=8, lm_head="int8").check()
