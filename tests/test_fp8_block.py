"""Block FP8 (`llmq quantize --method fp8 --group-size 128`): a float32 scale per 128 x 128 weight block, activations
quantized per token per group of 128 at run time (compressed-tensors' FP8_BLOCK; DeepSeek-V3 and Qwen3-FP8 releases).

The arithmetic is checked against a float64 / brute-force reference and against compressed-tensors' own
quantize / dequantize for the block strategy; the checkpoint against compressed-tensors' preset and vLLM's loader
expectations written down as data; the runtime against a float64 dequantize-then-matmul model. Random draws use
fixed seeds, each check repeated over many of them where a rounding tie could matter.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import llmq_logits, small_engine

from llmq import quant
from llmq.errors import LlmqError
from llmq.models import qformat
from llmq.models.linear_weights import LinearWeights
from llmq.models.reader import CheckpointReader
from llmq.models.sharding import split_cols, split_rows
from llmq.quant import fp8_block
from llmq.runtime.layers import cpu_kernels

E4M3 = np.array([(c & 7) / 8 * 2.0 ** -6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
                 for c in range(127)])  # every non-negative finite E4M3 value, from its bit fields
SEEDS = range(20)


def _e4m3_ref(x: np.ndarray) -> np.ndarray:
    """x rounded to E4M3 by brute force: the nearest value, ties to the even code, saturating at 448."""
    a = np.abs(x).reshape(-1, 1)
    d = np.abs(a - E4M3.reshape(1, -1))
    best = d == d.min(1, keepdims=True)
    idx = np.where(best.sum(1) > 1, np.argmax(best & (np.arange(127) % 2 == 0), 1), np.argmax(best, 1))
    return (np.sign(x).reshape(-1) * E4M3[idx]).reshape(x.shape)


def _weight(seed: int, n: int = 200, k: int = 300) -> torch.Tensor:
    """A random weight whose 128 x 128 blocks (partial ones at the edges) range over many magnitudes, with an all-zero
    block."""
    gen = np.random.default_rng(seed)
    mag = np.exp2(gen.integers(-10, 6, (math.ceil(n / 128), math.ceil(k / 128))))
    w = gen.standard_normal((n, k)) * mag.repeat(128, 0).repeat(128, 1)[:n, :k]
    w[128:, :128] = 0.0
    return torch.from_numpy(w.astype(np.float32))


def _block_amax(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    n, k = w.shape
    return np.array([[np.abs(w[i:i + bn, j:j + bk]).max() for j in range(0, k, bk)] for i in range(0, n, bn)])


def _block_scales_ref(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    return np.maximum(_block_amax(w, bn, bk).astype(np.float32), np.float32(quant.EPS)) / np.float32(448)  # float32


@pytest.mark.parametrize("seed", SEEDS)
def test_block_weights_match_the_float64_reference(seed):
    """Scales are block amax / 448 in float32, [ceil(N/128), ceil(K/128)]; each value is the E4M3 value nearest its
    exact quotient; dequantization is that value times its block's scale."""
    w = _weight(seed)
    q, scale = quant.fp8_block_quantize(w)
    s_ref = _block_scales_ref(w.numpy().astype(np.float64), 128, 128)
    assert scale.dtype == torch.float32
    assert scale.shape == (2, 3)
    assert np.array_equal(scale.numpy(), s_ref)
    s_full = s_ref.astype(np.float64).repeat(128, 0).repeat(128, 1)[:200, :300]
    q_ref = _e4m3_ref(w.numpy().astype(np.float64) / s_full)
    assert q.dtype == torch.float8_e4m3fn, f"seed {seed}"
    assert np.array_equal(q.double().numpy(), q_ref), f"seed {seed}"
    got = quant.dequantize_fp8_blocks(q, scale).double().numpy()
    want = q_ref * s_full
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -24)   # one float32 rounding of the product
    assert np.abs(got - w.numpy()).max() <= np.abs(w.numpy()).max() / 16   # and close to w: 3 mantissa bits


@pytest.mark.parametrize("seed", SEEDS)
def test_token_groups_match_the_reference(seed):
    """Activations: per token and 128 columns (the last group partial), scale group amax / 448 and quotient in
    float32 (vLLM's kernel), then the nearest E4M3 value."""
    gen = np.random.default_rng(1000 + seed)
    x = (gen.standard_normal((5, 300)) * np.exp2(gen.integers(-8, 8, (5, 1)))).astype(np.float32)
    x[2, 128:256] = 0.0
    q, s = quant.quantize_token_groups(torch.from_numpy(x))
    amax = np.stack([np.abs(x[:, j:j + 128]).max(1) for j in range(0, 300, 128)], 1)
    s_ref = np.maximum(amax, np.float32(quant.EPS)) / np.float32(448)
    assert s.shape == (5, 3)
    assert np.array_equal(s.numpy(), s_ref)
    quot = x / s_ref.repeat(128, 1)[:, :300]   # float32 division
    assert np.array_equal(q.double().numpy(), _e4m3_ref(quot.astype(np.float64)))


@pytest.mark.parametrize("seed", SEEDS)
def test_compressed_tensors_block_quantization_agrees(seed):
    """compressed-tensors' FP8_BLOCK arithmetic (its scale rule, its blockwise quantize with padding of partial
    blocks, its dequantize) on the same weight: the same scales, the same dequantized values; the stored values are
    the same except where its float32 quotient rounds differently from llmq's exact one (llmq rounds once)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights
    w = _weight(seed)
    q, scale = quant.fp8_block_quantize(w)
    amax = torch.from_numpy(_block_amax(w.numpy(), 128, 128))
    ct_scale, _ = calculate_qparams(-amax, amax, args)
    nonzero = amax > 0   # an all-zero block: compressed-tensors' eps, llmq's; its values are 0 either way
    assert torch.equal(ct_scale.float()[nonzero], scale[nonzero])
    ct_q = quantize(w, scale, None, args, dtype=quant.FP8)
    once = quant.to_fp8(w, fp8_block._expand(scale, (200, 300), (128, 128)))   # float32 quotient, as compressed-tensors
    assert torch.equal(ct_q.view(torch.uint8), once.view(torch.uint8))
    differ = q.view(torch.uint8) != ct_q.view(torch.uint8)
    assert int(differ.sum()) <= 2, f"seed {seed}"   # only float32 quotients a hair off an E4M3 tie
    ct_w = dequantize(q, scale, args=args, dtype=torch.float32)
    assert torch.equal(ct_w, quant.dequantize_fp8_blocks(q, scale))


def _qw(seed: int, n: int, k: int) -> qformat.QuantizedWeight:
    from llmq.pipeline.quantize.fp8 import quantize_weight_fp8_block

    return quantize_weight_fp8_block(_weight(seed, n, k))


@pytest.mark.parametrize("seed", SEEDS)
def test_runtime_layer_equals_the_float64_dequantize_then_matmul(seed):
    """The CPU layer: activations rounded per token group exactly, times the dequantized weight, float32 sums."""
    from llmq.runtime.loader import quantized_linear

    qw = _qw(seed, 200, 300)
    x = torch.from_numpy(np.random.default_rng(2000 + seed).standard_normal((7, 300)).astype(np.float32))
    layer = quantized_linear(qw, None, torch.float32, "cpu")
    assert type(layer).__name__ == "BlockFP8Linear"
    got = layer(x).double()
    xq, xs = quant.quantize_token_groups(x)
    xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, :300]
    wd = qw.q.double() * qw.scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    want = xd @ wd.T
    bound = 300 * 2.0 ** -23 * (xd.abs() @ wd.abs().T)   # float32 products and sums
    assert torch.all((got - want).abs() <= bound), f"seed {seed}"
    unquantized = x.double() @ wd.T   # the emulated activation rounding is visible well above that bound
    assert (unquantized - want).abs().max() > 1000 * (got - want).abs().max()


@pytest.mark.parametrize("m, n, k", [(1, 256, 384), (3, 128, 1024), (17, 384, 128)])
def test_the_cuda_call_passes_torchs_layout_checks(m, n, k):
    """No GPU here: the Hopper path's F.scaled_mm call (BlockWise1x128 x BlockWise128x128) runs on meta tensors, where
    torch checks the shapes and strides of both scale operands (decode's single row included)."""
    from llmq.runtime.layers.fp8_block import blockwise_scaled_mm, scaled_mm_weight_scales

    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    sb = scaled_mm_weight_scales(torch.empty(n // 128, k // 128, device="meta"))
    y = blockwise_scaled_mm(torch.empty(m, k, device="meta"), w, sb)
    assert y.shape == (m, n)
    assert y.dtype == torch.bfloat16
    wrong = [sb.t().contiguous()] + ([sb.contiguous()] if n > 128 else [])   # untransposed; row-major
    for bad in wrong:   # the checks bite
        with pytest.raises(RuntimeError, match="blockwise scaling"):
            blockwise_scaled_mm(torch.empty(m, k, device="meta"), w, bad)


def test_fused_projections_share_scale_rows_only_on_block_edges():
    """q/k/v as one layer when every part but the last fills whole 128-row blocks; otherwise each part keeps its own
    layer, and where the CPU kernel runs them (per-row scales) the packed parts are joined into one layer. All
    compute the parts' outputs."""
    from llmq.runtime.layers.fp8_block import BlockFP8Linear
    from llmq.runtime.loader import ConcatLinear, build_linear

    packed = cpu_kernels.fp8_fits(64, 192, 128)
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 192)).astype(np.float32))
    for rows, concat in (((128, 256, 64), False), ((64, 128), True)):
        parts = [LinearWeights(f"p{i}", qw=_qw(10 + i, n, 192)) for i, n in enumerate(rows)]
        layer = build_linear(parts, torch.float32, "cpu")
        assert isinstance(layer, ConcatLinear) == (concat and not packed)
        assert isinstance(layer, BlockFP8Linear) == (not concat or packed)
        want = torch.cat([build_linear([p], torch.float32, "cpu")(x) for p in parts], -1)
        assert torch.equal(layer(x), want)


def test_tensor_parallel_cuts_follow_blocks_and_refuse_to_split_one():
    """Column and row cuts keep each block's scale with its rows / columns; a rank inside one block keeps that block's
    scale, a reordering inside blocks keeps them; a selection that would put two source blocks into one is refused."""
    lw = LinearWeights("model.layers.0.mlp.down_proj", qw=_qw(3, 256, 384))
    full = lw.qw.dequantize()
    for idx in (torch.arange(128, 256), torch.arange(0, 64), torch.arange(320, 384)):
        assert torch.equal(split_cols(lw, idx).qw.dequantize(), full[:, idx])
    for idx in (torch.arange(128, 256), torch.arange(0, 64), torch.arange(192, 256)):
        assert torch.equal(split_rows(lw, idx).qw.dequantize(), full[idx])
    perm = torch.arange(256).view(-1, 32).flip(-1).reshape(-1)   # rows reordered within 32-row heads (GGUF's q/k)
    assert torch.equal(split_rows(lw, perm).qw.dequantize(), full[perm])
    with pytest.raises(LlmqError, match="different 128 x 128 FP8 blocks into one block"):
        split_cols(lw, torch.arange(64, 256))
    with pytest.raises(LlmqError, match="different 128 x 128 FP8 blocks into one block"):
        split_rows(lw, torch.arange(256).roll(64))


# -- the checkpoint --------------------------------------------------------------------------------------------------
# vLLM's compressed-tensors W8A8 FP8 scheme with a block_structure (compressed_tensors_w8a8_fp8.py, fp8_utils.py), as
# data: which tensors a block-FP8 linear has, their dtypes, and the scale shape; plus the config group.
VLLM_EXPECTS = {
    "tensors": {"weight": "float8_e4m3fn", "weight_scale": "float32"},
    "scale_shape": lambda n, k: (math.ceil(n / 128), math.ceil(k / 128)),
    "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True,
                "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True,
                          "symmetric": True},
    "format": "float-quantized",
    "k_multiple": 128,   # its per-token-group activation kernel (and compressed-tensors' forward) need K % 128 == 0
}


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model):
    """{hidden: (store, source, quantized)}: tiny bf16 Llamas of hidden 64 (partial blocks everywhere) and 128
    (the widths vLLM's kernels take), quantized --method fp8 --group-size 128."""

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    d = tmp_path_factory.mktemp("fp8b")
    store = Store(d / "store")
    out = {}
    for hidden in (64, 128):
        path = tiny_model(seed=5, name=f"tiny{hidden}", bf16=True, hidden_size=hidden, intermediate_size=2 * hidden)
        src = resolve_model(str(path), store)
        out[hidden] = store, src, quantize(src, QuantizeOptions(method="fp8", group_size=128, probe_tokens=256,
                                                                name=f"tiny{hidden}-fp8b"), store, progress=False)
    return out


def _plain_dequantize(path) -> dict[str, torch.Tensor]:
    """An independent reader: safetensors + torch only. Every `weight` with a `weight_scale` is q times the scale of
    its 128 x 128 block."""
    from safetensors.torch import load_file

    t = {}
    for f in sorted(path.glob("*.safetensors")):
        t |= load_file(f)
    out = {}
    for key, s in t.items():
        if key.endswith(".weight_scale"):
            name = key[:-len(".weight_scale")]
            q = t[f"{name}.weight"].to(torch.float64)
            n, k = q.shape
            out[name] = q * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return out


@pytest.mark.parametrize("hidden", [64, 128])
def test_checkpoint_is_what_vllm_loads(made, hidden):
    from compressed_tensors.quantization import preset_name_to_scheme

    art = made[hidden][2]
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    assert cfg["format"] == VLLM_EXPECTS["format"]
    assert cfg["ignore"] == ["lm_head"]
    (group,) = cfg["config_groups"].values()
    preset = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    for kind in ("weights", "input_activations"):
        assert group[kind] == getattr(preset, kind).model_dump(mode="json", exclude_none=True)
        assert VLLM_EXPECTS[kind].items() <= group[kind].items()
    assert art.config["scheme"] == "FP8-block128x128-dynamic"
    plain = _plain_dequantize(art.path)
    assert len(plain) == 14   # 7 linears x 2 layers
    qc = qformat.parse_quantization_config(ck.config)
    for name, w in plain.items():
        stored = {k.rsplit(".", 1)[1]: ck.tensors[k] for k in ck.tensors if k.rsplit(".", 1)[0] == name}
        assert {k: str(v.dtype).removeprefix("torch.") for k, v in stored.items()} == VLLM_EXPECTS["tensors"]
        n, k = stored["weight"].shape
        assert tuple(stored["weight_scale"].shape) == VLLM_EXPECTS["scale_shape"](n, k)
        assert (k % VLLM_EXPECTS["k_multiple"] == 0) == (hidden == 128 or name.endswith("down_proj"))
        qw = qformat.read_linear(ck.tensors, name, qc)
        assert torch.equal(qw.dequantize().double(), w.float().double()), name   # float32 product, both readers
        assert torch.equal(qformat.write_linear(name, qw)[f"{name}.weight"].view(torch.uint8),
                           stored["weight"].view(torch.uint8))


@pytest.mark.parametrize("hidden", [64, 128])
def test_runtime_equals_a_float64_reference_model(made, hidden):
    """transformers in float64 with the independently dequantized weights, activations rounded per token group in each
    linear's forward (the reference): llmq's runtime layer for every linear, fed the very activations the reference
    feeds it, gives its float64 output to float32 rounding. Whole models are compared loosely: the activations of the
    two differ by float32 rounding, and one that lands on the other side of an E4M3 rounding boundary (1/16 apart)
    changes every later layer, so equal logits are not expected; both are close to each other and to the probe."""
    from transformers import AutoModelForCausalLM

    from llmq.runtime.loader import build_linear

    store, src, art = made[hidden]
    plain = _plain_dequantize(art.path)
    ck = CheckpointReader(art.path)
    m = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float64).eval()
    seen, raw = [], {}
    for name, w in plain.items():
        mod = m.get_submodule(name)
        mod.weight.data = w
        layer = build_linear([ck.linear(name)], torch.float32, "cpu")

        def pre(_, a, name=name):
            raw[name] = a[0]
            return (_fake_quant_groups(a[0]),)

        def post(_, a, out, name=name, layer=layer):
            got = layer(raw[name].float()).double()
            assert (got - out).abs().max() <= 1e-5 * out.abs().max(), name
            seen.append(name)

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(hidden))
    with torch.no_grad():
        want = torch.log_softmax(m(ids).logits, -1)[0]
    assert sorted(seen) == sorted(plain)
    got = llmq_logits(art.path, ids)[0].double()
    kld = (want.exp() * (want - got)).sum(-1).mean().item()
    assert kld < 0.01
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
    assert 0 < art.metrics["probe"]["kld_mean"] < 0.05


def _fake_quant_groups(x: torch.Tensor) -> torch.Tensor:
    """Per token, per 128 columns: round x / (amax / 448) to E4M3 (float32 quotient) and scale back, in float64."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    out = torch.empty_like(x, dtype=torch.float64)
    for j in range(0, x.shape[1], 128):
        g = x[:, j:j + 128]
        s = g.abs().amax(1, keepdim=True).clamp_min(quant.EPS) / 448
        out[:, j:j + 128] = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()
    return out.reshape(shape)


def test_tp2_build_cuts_on_block_edges_and_passes_the_reference_check(made):
    """`build --tp 2` of the hidden-128 model: every cut (64 q rows, 32 KV rows, 128 MLP rows / columns, 64 o_proj
    columns) lies inside or on the edge of a 128 x 128 block, and the sharded engine reproduces the unsharded one."""
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _, art = made[128]
    eng = build_engine(art, store, BuildOptions(target="llmq", tp=2, verify=True))
    assert eng.metrics["verify"]["passed"]
    assert eng.metrics["verify"]["max_rel_error"] < 1e-5


def test_transformers_loads_the_checkpoint_with_llmqs_tensors(made):
    """transformers' compressed-tensors loader keeps the FP8 weights and block scales exactly as llmq wrote them."""
    from transformers import AutoModelForCausalLM

    art = made[128][2]
    ck = CheckpointReader(art.path)
    model = AutoModelForCausalLM.from_pretrained(art.path, dtype=torch.float32)
    for name in _plain_dequantize(art.path):
        mod = model.get_submodule(name)
        assert torch.equal(mod.weight.view(torch.uint8), ck.tensors[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(mod.weight_scale.float(), ck.tensors[f"{name}.weight_scale"])


def test_a_hugging_face_fp8_release_is_read_evaluated_and_served(made, tmp_path):
    """The DeepSeek-V3 / Qwen3-FP8 layout (quant_method "fp8", weight_block_size, `weight_scale_inv`) is the same
    scheme: llmq reads the same weights, computes the same logits, and generates from it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmq.runtime import SamplingParams

    art = made[128][2]
    dst = tmp_path / "hf-fp8"
    shutil.copytree(art.path, dst, ignore=shutil.ignore_patterns("*.safetensors", "llmq.json"))
    tensors = {}
    for f in art.path.glob("*.safetensors"):
        tensors |= {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in load_file(f).items()}
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    a, b = CheckpointReader(art.path), CheckpointReader(dst)
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(a.linear(name).qw.dequantize(), b.linear(name).qw.dequantize())
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(llmq_logits(art.path, ids), llmq_logits(dst, ids))
    eng = small_engine(dst)
    try:
        (out,) = eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        eng.shutdown()
    assert len(out.new_token_ids) == 6
    cfg["quantization_config"]["activation_scheme"] = "static"
    with pytest.raises(LlmqError, match="weight_block_size"):
        qformat.parse_quantization_config(cfg)


@pytest.mark.parametrize("args, match", [
    (["--method", "fp8", "--group-size", "64"], "use --group-size 128"),
    (["--method", "fp8", "--group-size", "128", "--activations", "static"], "use --group-size 128"),
    (["--method", "fp8", "--group-size", "128", "--asym"], "use --group-size 128"),
    (["--method", "fp8", "--group-size", "128", "--per-tensor"], "exclude each other"),
])
def test_unsupported_combinations_are_one_line_errors(made, args, match):
    from llmq.cli.main import cli

    store, src, _ = made[64]
    r = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", src.ref, *args])
    assert r.exit_code == 2, r.output
    assert match in r.output, r.output
    assert r.output.startswith("error: "), r.output
    assert r.output.strip().count("\n") == 0


def test_gguf_refuses_block_fp8_in_one_line(made):
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _, art = made[128]
    with pytest.raises(LlmqError, match="FP8 weights have no GGUF block format"):
        build_engine(art, store, BuildOptions(target="gguf"))


def test_cli_quantize_then_eval(made, tmp_path, monkeypatch):
    """`llmq quantize --method fp8 --group-size 128` then `llmq eval`: the commands a user runs."""
    from llmq.cli.main import cli

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store, src, _ = made[64]
    runner = CliRunner()
    q = runner.invoke(cli, ["--store", str(store.root), "quantize", src.ref, "--method", "fp8", "--group-size", "128",
                            "--name", "tiny-fp8b-cli", "--probe-tokens", "128"])
    assert q.exit_code == 0, q.output
    r = runner.invoke(cli, ["--store", str(store.root), "eval", "tiny-fp8b-cli", "--tasks", "ppl,kld", "--limit",
                            "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert 0 < rep["kld"]["mean"] < 0.05
