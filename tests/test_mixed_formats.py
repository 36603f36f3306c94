"""`llmq quantize --target-bpw B --for ENGINE`: mixed precision across formats. The knapsack over the catalogue's
schemes is optimal, each engine is offered only what it loads, the sensitivity pass measures each scheme's KLD where
asked, and the artifact is compressed-tensors' mixed-precision config (a format per group, a fused unit in one group,
lm_head consistent) that llmq reads back to the logits compressed-tensors' own decompressors give, and whose GGUF
export stores each weight in its own block type."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import bf16_kernels_off, runtime_logprobs

from llmq.errors import LlmqError
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize import QuantizeOptions, mixed, quantize, schemes
from llmq.pipeline.quantize.probe import kld_top1

FORMAT = {"int4": "pack-quantized", "int5": "pack-quantized", "int8": "pack-quantized",
          "fp8": "float-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
SCHEME_NAME = {"int4": "W4A16-group32-sym", "int5": "W5A16-group32-sym",
               "int8": "W8A16-channel-sym", "fp8": "FP8-channel",
               "nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "16bit": "dense"}
COMMON = dict(bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_bf16_store

    return tiny_bf16_store(tmp_path_factory.mktemp("mixed-formats"), seed=5, num_hidden_layers=3)


def _designated(monkeypatch, order: list[str]):
    """The plan's losses replaced so that unit n loses nothing in scheme order[n % len(order)] alone: the knapsack
    with room for everything then puts each unit in its designated scheme, so one artifact holds every scheme."""
    def losses(sens, keys, cands):
        names = [c.name for c in cands]
        out = np.ones((len(keys), len(cands)))
        for n in range(len(keys)):
            out[n, names.index(order[n % len(order)])] = 0.0
        return out

    monkeypatch.setattr(mixed, "losses", losses)


def _chosen(art) -> dict[str, str]:
    return {f"model.layers.{u['layer']}.{m}": u["scheme"] for u in art.config["mixed_precision"]["units"]
            for m in u["modules"]}


@pytest.mark.parametrize("seed", range(4))
def test_the_knapsack_over_six_schemes_is_optimal(seed):
    """Against brute force over every assignment of 5 units x 6 schemes (costs not sorted with losses: a cheaper
    scheme can lose less, as MXFP4 against INT4 g32 does)."""
    g = np.random.default_rng(seed)
    costs = g.integers(1, 60, (5, 6)).astype(float) * 4
    losses = g.random((5, 6))
    budget = int(costs.min(1).sum() + g.random() * (costs.max(1).sum() - costs.min(1).sum()))
    best = min(sum(losses[i, j] for i, j in enumerate(p)) for p in itertools.product(range(6), repeat=5)
               if sum(costs[i, j] for i, j in enumerate(p)) <= budget)
    got = mixed.choose(losses, costs, budget)
    assert sum(costs[i, j] for i, j in enumerate(got)) <= budget
    assert sum(losses[i, j] for i, j in enumerate(got)) == pytest.approx(best, abs=1e-12)


def test_each_engine_is_offered_only_what_it_loads():
    shapes = [(64, 64), (128, 64), (64, 128)]
    opts = QuantizeOptions(target_bpw=6, **COMMON).resolved((64, 128))
    names = lambda engine, o=opts, s=shapes: {c.name for c in schemes.candidates(engine, s, o)}  # noqa: E731
    assert names(None) == {"int4", "int8", "16bit"}   # without --for: today's integer widths
    assert names("llmq") == {"int4", "int5", "int8", "fp8", "nvfp4", "mxfp4", "16bit"}
    assert names("vllm") == names("llmq") - {"int5"}   # INT5 runs in llmq's runtime and llama.cpp only
    assert names("trtllm") == {"int4", "int8", "16bit"}
    assert names("gguf") == {"int4", "int5", "int8", "nvfp4", "mxfp4", "16bit"}
    assert "nvfp4" not in names("gguf", s=[(64, 96)])   # GGUF's NVFP4 blocks hold 64 weights
    grouped = QuantizeOptions(target_bpw=6, int8_group_size=32, **COMMON).resolved((64, 128))
    assert "int8" in names("gguf", grouped)
    assert "int8" not in names("trtllm", grouped)   # TensorRT-LLM: per channel
    asym = QuantizeOptions(target_bpw=6, symmetric=False, **COMMON).resolved((64, 128))
    assert "int8" not in names("gguf", asym)
    assert "int4" in names("gguf", asym)   # Q8_0 has no zero point; Q4_1 does
    assert "int5" in names("gguf", asym)   # Q5_1 does too
    # bytes exactly as stored: values, scales (bf16; E4M3 / E8M0 bytes for FP4), NVFP4's float32 global scale
    n, k = 128, 64
    assert schemes.SCHEMES["int4"].checkpoint_bytes(n, k, opts) == n * k // 2 + n * (k // 32) * 2
    assert schemes.SCHEMES["int5"].checkpoint_bytes(n, k, opts) == n * k * 5 // 8 + n * (k // 32) * 2   # g32 always
    assert schemes.SCHEMES["int5"].gguf_bytes(n, k, opts) == n * k // 32 * 22   # Q5_0: 5.5 bits a weight
    assert schemes.SCHEMES["int5"].gguf_bytes(n, k, asym) == n * k // 32 * 24   # Q5_1
    assert schemes.width_grid(5, QuantizeOptions(target_bpw=6, bits=4, group_size=128).resolved((64, 128))) == (5, 32)
    assert schemes.SCHEMES["fp8"].checkpoint_bytes(n, k, opts) == n * k + n * 2
    assert schemes.SCHEMES["nvfp4"].checkpoint_bytes(n, k, opts) == n * k // 2 + n * k // 16 + 4
    assert schemes.SCHEMES["mxfp4"].checkpoint_bytes(n, k, opts) == n * k // 2 + n * k // 32
    assert schemes.SCHEMES["mxfp4"].gguf_bytes(n, k, opts) == n * k // 32 * 17
    assert schemes.SCHEMES["nvfp4"].gguf_bytes(n, k, opts) == n * k // 64 * 36 + schemes.NVFP4_SCALE_ENTRY


def test_for_is_checked_before_any_work():
    with pytest.raises(LlmqError, match="give --target-bpw or --max-size too"):
        QuantizeOptions(for_engine="vllm").check()
    with pytest.raises(LlmqError, match="--size-in gguf prices the GGUF file, which vllm does not load"):
        QuantizeOptions(target_bpw=6, size_in="gguf", for_engine="vllm").check()
    with pytest.raises(LlmqError, match="--for gguf: GGUF's blocks hold 32 weights"):
        QuantizeOptions(target_bpw=6, for_engine="gguf", bits=4, group_size=16).check()
    with pytest.raises(LlmqError, match="--for trtllm: .* no zero points; drop --asym"):
        QuantizeOptions(target_bpw=6, for_engine="trtllm", symmetric=False).check()
    with pytest.raises(LlmqError):
        QuantizeOptions(target_bpw=6, for_engine="tensorrt").check()


def test_the_sensitivity_of_each_scheme_is_the_kld_of_rounding_that_unit_to_it(tiny):
    """measure(direct=...): each scheme's number is the KLD of the float model with just that unit in that scheme,
    computed independently with transformers; the MSEs rank the schemes as their rounding errors do."""
    from transformers import AutoModelForCausalLM

    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.stage import validate

    store, src = tiny
    opts, spec, _ = validate(src, QuantizeOptions(target_bpw=6, for_engine="llmq", **COMMON))
    windows = load_calibration(None, load_tokenizer(src.path), 2, 64, 0)
    cands = mixed.candidates(spec, opts)
    direct = ("int4", "fp8", "nvfp4", "mxfp4")
    got = mixed.measure(src.path, spec, opts, windows, "cpu", False, cands, direct, layers=(1,))
    units = spec.arch.unit_paths()
    assert set(got) == {(1, u) for u in range(len(units))}
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    ids = torch.stack(windows.samples)
    half = ids.shape[1] // 2
    with torch.no_grad():
        ref = model(ids).logits[:, half:]
    for u in (0, 3):
        lins = [model.get_submodule(f"model.layers.1.{n}") for n in units[u]]
        kept = [lin.weight.data.clone() for lin in lins]
        for name in direct:
            for lin, qw in zip(lins, schemes.SCHEMES[name].quantize_unit(kept, opts, torch.bfloat16)):
                lin.weight.data = qw.dequantize()
            with torch.no_grad():
                want = kld_top1(ref, model(ids).logits[:, half:])["kld_mean"]
            assert got[(1, u)]["kld"][name] == pytest.approx(want, rel=1e-3), (u, name)
            for lin, w in zip(lins, kept):
                lin.weight.data = w
        mse = got[(1, u)]["mse"]
        assert mse["16bit"] == 0 < mse["fp8"] < mse["int4"]
        assert mse["int8"] < mse["fp8"]


def test_a_plan_for_an_engine_uses_only_what_it_loads_and_fuses_units_whole(tiny):
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.stage import validate

    store, src = tiny
    calib = load_calibration(None, load_tokenizer(src.path), 4, 64, 0)
    for engine, allowed in (("trtllm", {"int4", "int8", "16bit"}), ("gguf", {"int4", "int5", "int8", "nvfp4",
                                                                              "mxfp4", "16bit"})):
        opts, spec, _ = validate(src, QuantizeOptions(target_bpw=5.5, for_engine=engine, **COMMON))
        plan = mixed.plan(src.path, spec, opts, calib, "cpu", progress=False)
        m = plan.manifest
        assert set(plan.schemes.values()) <= allowed
        assert set(m["candidates"]) == allowed
        assert m["bytes"] <= m["budget_bytes"]
        assert m["bpw"] <= 5.5
        low = {c for c in allowed if schemes.SCHEMES[c].bits in (4, 5)}   # measured; the 8-bit ones scaled from INT4
        assert set(m["sensitivity"]["measured"]) == low
        assert all(set(u["kld_alone"]) == low for u in m["units"])
        for i in range(spec.num_layers):
            for unit in spec.arch.unit_paths():
                assert len({plan.schemes[f"model.layers.{i}.{n}"] for n in unit}) == 1


@pytest.fixture(scope="module")
def every_scheme(tiny):
    """An artifact (--for llmq) with each unit in a designated scheme, every scheme at least once."""
    store, src = tiny
    with pytest.MonkeyPatch.context() as mp:
        _designated(mp, ["fp8", "nvfp4", "mxfp4", "int8", "16bit", "int4", "int5"])
        art = quantize(src, QuantizeOptions(target_bpw=16, for_engine="llmq", **COMMON), store, progress=False)
    return store, src, art


def test_the_artifact_is_compressed_tensors_mixed_precision_one_group_per_scheme(every_scheme):
    store, src, art = every_scheme
    chosen = _chosen(art)
    assert set(chosen.values()) == set(schemes.SCHEMES)
    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    assert cfg["format"] == "mixed-precision"
    group_of = {}
    for g in cfg["config_groups"].values():
        assert "input_activations" not in g   # every scheme weight-only
        for t in g["targets"]:
            group_of[t] = g
    linear = group_of.pop("Linear")
    for name, scheme in chosen.items():
        if scheme == "16bit":
            assert name in cfg["ignore"]
            assert name not in group_of
            assert f"{name}.weight" in ck.tensors
            continue
        g = group_of.get(name, linear)
        assert g["format"] == FORMAT[scheme], name
        assert art.config["scheme_per_module"].get(name, art.config["scheme_per_module"]["Linear"]) == \
            SCHEME_NAME[scheme], name
        assert ck.qconfig.format_of(name) == FORMAT[scheme]
        assert ck.linear(name).qw.scheme == SCHEME_NAME[scheme]
    # a fused unit (q/k/v, gate/up) sits in one group: vLLM refuses a fused layer with different schemes
    for i in range(3):
        for unit in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            assert len({id(group_of.get(f"model.layers.{i}.{n}", linear)) for n in unit}) == 1
            qws = [ck.linear(f"model.layers.{i}.{n}").qw for n in unit]
            if qws[0] is not None and qws[0].global_scale is not None:   # NVFP4: one global scale per unit
                assert all(torch.equal(q.global_scale, qws[0].global_scale) for q in qws)
    # lm_head: dense, in ignore, and nothing of a quantized head written (vllm#45102)
    assert "lm_head" in cfg["ignore"]
    assert not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in ck.tensors)


def _decompressed_reference(art, src):
    """The source model in float64 with every quantized linear as compressed-tensors' own decompressor for its
    group's format reads it from the checkpoint, the 16-bit ones as stored."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers import AutoModelForCausalLM

    ck = CheckpointReader(art.path)
    cfg = ck.config["quantization_config"]
    group_of = {t: g for g in cfg["config_groups"].values() for t in g["targets"]}
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float64).eval()
    for i in range(ck.spec.num_layers):
        for name in ck.arch.linear_names(i):
            if name in cfg["ignore"]:
                model.get_submodule(name).weight.data = ck.tensors[f"{name}.weight"].double()
                continue
            g = group_of.get(name, group_of["Linear"])
            stored = {k[len(name) + 1:]: ck.tensors[k] for k in ck.tensors if k.startswith(name + ".")}
            if g["format"] in ("pack-quantized", "float-quantized"):
                stored["weight_scale"] = stored["weight_scale"].float()
            scheme = QuantizationScheme.model_validate(g)
            if g["format"] == "nvfp4-pack-quantized":   # its decompressor's two steps in float64 (it returns bf16)
                packed = stored["weight_packed"]
                codes = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float64)
                w = dequantize(codes, stored["weight_scale"].double(), args=scheme.weights,
                               global_scale=stored["weight_global_scale"].double(), dtype=torch.float64)
            else:
                w = BaseCompressor.get_value_from_registry(g["format"]).decompress(stored, scheme)["weight"]
            model.get_submodule(name).weight.data = w.double()
    return model


def test_llmq_reads_the_mix_back_to_compressed_tensors_logits(every_scheme, monkeypatch):
    """The runtime loads each linear in its own format (fused units fused) and computes the logits of a float64
    model whose weights compressed-tensors' decompressors read from the same files."""
    store, src, art = every_scheme
    bf16_kernels_off(monkeypatch)
    ids = [int(x) for x in torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():
        ref = _decompressed_reference(art, src)(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = runtime_logprobs(art.path, ids).double()
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)
    assert kld_top1(ref, got)["top1"] == 1.0


def test_engines_that_cannot_load_a_scheme_of_the_mix_refuse_it_in_one_line(every_scheme):
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src, art = every_scheme
    with pytest.raises(LlmqError, match=r"FP8 weights have no GGUF block format") as e:
        build_engine(art, store, BuildOptions(target="gguf"))
    assert "\n" not in str(e.value)
    with pytest.raises(LlmqError) as e:
        build_engine(art, store, BuildOptions(target="trtllm"))
    assert "\n" not in str(e.value)


def test_a_mix_for_gguf_is_written_with_each_weights_own_block_type(tiny, monkeypatch):
    """`--for gguf`: every decoder weight is the GGUF block type of its scheme (Q4_0, Q5_0, Q8_0, NVFP4 with its
    `.scale`, MXFP4, BF16), and gguf-py's dequantizer (llama.cpp's NumPy twin) reads back the artifact's own values."""
    from test_export_gguf import _hf_name, _unpair_rope_rows, gguf_file

    from llmq.pipeline.targets import BuildOptions, build_engine

    gguf = pytest.importorskip("gguf")
    store, src = tiny
    _designated(monkeypatch, ["nvfp4", "int4", "mxfp4", "int8", "16bit", "int5"])
    art = quantize(src, QuantizeOptions(target_bpw=16, for_engine="gguf", name="mix-gguf", **COMMON), store,
                   progress=False)
    chosen = _chosen(art)
    assert set(chosen.values()) == {"nvfp4", "int4", "mxfp4", "int8", "16bit", "int5"}
    engine = build_engine(art, store, BuildOptions(target="gguf"))
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file(engine)).tensors}
    want = {"int4": "Q4_0", "int5": "Q5_0", "int8": "Q8_0", "nvfp4": "NVFP4", "mxfp4": "MXFP4", "16bit": "BF16"}
    ck = CheckpointReader(art.path)
    for t in tensors.values():
        if not (t.name.startswith("blk.") and t.name.endswith(".weight")) or len(t.shape) < 2:
            continue
        name = _hf_name(t.name)[:-len(".weight")]
        assert t.tensor_type == gguf.GGMLQuantizationType[want[chosen[name]]], name
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):   # llama.cpp's RoPE pairs rows (2i, 2i + 1)
            w = _unpair_rope_rows(w, 4 if "attn_q" in t.name else 2)
        scale = tensors.get(t.name.replace(".weight", ".scale"))
        assert (scale is not None) == (chosen[name] == "nvfp4"), name
        w = torch.from_numpy(np.array(w, dtype=np.float32)) * (float(scale.data[0]) if scale is not None else 1.0)
        torch.testing.assert_close(w, ck.linear(name).dense(torch.float32), rtol=1e-6, atol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_a_mix_for_gguf_keeps_nvfp4_off_the_ffn_where_llama_cpp_drops_its_scale(tmp_path, monkeypatch, model_type):
    """llama.cpp's qwen2 / gemma3 graphs leave out an FFN matrix's `.scale` (Arch.gguf_ffn_scale), so `--for gguf`
    never puts an FFN unit in NVFP4 there (nor spends a sensitivity pass on it), even where NVFP4 alone loses nothing;
    attention units still take it, and the build (which refuses an NVFP4 FFN for these architectures) writes the
    file."""
    from helpers import tiny_bf16_store

    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src = tiny_bf16_store(tmp_path, seed=6, model_type=model_type, num_hidden_layers=2, head_dim=16)
    _designated(monkeypatch, ["nvfp4"])
    art = quantize(src, QuantizeOptions(target_bpw=16, for_engine="gguf", name="mix-ffn", **COMMON), store,
                   progress=False)
    chosen = _chosen(art)
    attention = {n: s for n, s in chosen.items() if ".self_attn." in n}
    ffn = {n: s for n, s in chosen.items() if ".mlp." in n}
    assert attention
    assert set(attention.values()) == {"nvfp4"}
    assert ffn
    assert "nvfp4" not in ffn.values()
    assert "nvfp4" in art.config["mixed_precision"]["candidates"]
    units = art.config["mixed_precision"]["units"]   # and NVFP4's KLD is measured only where it may be chosen
    assert all(("nvfp4" in u["kld_alone"]) == u["modules"][0].startswith("self_attn.") for u in units)
    build_engine(art, store, BuildOptions(target="gguf"))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_calibrated_methods_round_the_integer_units_and_leave_the_formats_theirs(tiny, method, monkeypatch):
    """GPTQ / AWQ take the integer units; the FP8 / NVFP4 / MXFP4 ones (AWQ folds no scales into them) are rounded to
    nearest after the method, each stored in its own scheme."""
    store, src = tiny
    _designated(monkeypatch, ["fp8", "nvfp4", "mxfp4", "int8", "16bit", "int4", "int5"])
    art = quantize(src, QuantizeOptions(method=method, target_bpw=16, for_engine="llmq", **COMMON), store,
                   progress=False)
    ck = CheckpointReader(art.path)
    for name, scheme in _chosen(art).items():
        qw = ck.linear(name).qw
        assert (qw.scheme if qw is not None else "dense") == SCHEME_NAME[scheme], name
