"""`llmq build --target trtllm` of block-FP8 and mixed-precision artifacts: quant_algo FP8_BLOCK_SCALES and
MIXED_PRECISION (hf_quant_config.json + quant_cfg.json), checked against TensorRT-LLM's loader as data
(tests/data/trtllm_loaders.json, recorded from its code: tensor names, dtypes, shapes, where the fused loader puts a
part's block scales, how it finds a layer's quant_algo), read back by the independent reader (`--verify`) and imported
again as the model it came from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import llmq_logits, make_tiny_model
from safetensors.torch import load_file

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.linear_weights import LinearWeights
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.targets import BuildOptions, build_engine
from llmq.pipeline.targets.trtllm import check_backend_layer

FACTS = json.loads((Path(__file__).parent / "data" / "trtllm_loaders.json").read_text())
FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
ALONE = ("self_attn.o_proj", "mlp.down_proj")
LINEARS = tuple(f"{p}.{r}" for p, roles in FUSED for r in roles) + ALONE
BLOCK = FACTS["fp8_block_scales"]["block"][0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from llmq.artifacts import Store

    return Store(tmp_path_factory.mktemp("trtllm-bm") / "store")


def _model(store, tmp_path_factory, name, **kw):
    return resolve_model(str(make_tiny_model(tmp_path_factory.mktemp(name) / "m", seed=5, **kw)), store)


@pytest.fixture(scope="module")
def block_art(store, tmp_path_factory):
    """Block FP8 of a model whose q (256 rows), k / v (128) and gate / up (256) parts are whole 128-row blocks and
    whose hidden size 192 leaves partial edge blocks in every q/k/v/gate/up column and o/down row."""
    src = _model(store, tmp_path_factory, "block", hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=128, intermediate_size=256)
    return quantize(src, QuantizeOptions(method="fp8", group_size=128, probe_tokens=0), store, progress=False)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    st = {}
    for f in ckpt.glob("*.safetensors"):
        st |= load_file(str(f))
    return st


def _shape(spec: list[str], out: int, inn: int) -> tuple[int, ...]:
    dims = {"out": out, "in": inn, f"ceil(out/{BLOCK})": math.ceil(out / BLOCK),
            f"ceil(in/{BLOCK})": math.ceil(inn / BLOCK)}
    return tuple(dims[d] for d in spec)


def _loader_fused_scale(parts: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """FP8BlockScalesLinearMethod's fused weight_scale: part i's scale rows at ceil(offset / 128)."""
    fused = torch.zeros(math.ceil(sum(rows) / BLOCK), parts[0].shape[1])
    offset = 0
    for s, n in zip(parts, rows):
        start = math.ceil(offset / BLOCK)
        fused[start:start + math.ceil(n / BLOCK)] = s
        offset += n
    return fused


def _gemm_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the block GEMM multiplies: weight row r, column c times scale[r // 128, c // 128]."""
    full = scale.repeat_interleave(BLOCK, 0)[:w.shape[0]].repeat_interleave(BLOCK, 1)[:, :w.shape[1]]
    return w.float() * full


def test_fp8_block_scales_checkpoint_is_what_the_loader_reads(store, block_art):
    facts = FACTS["fp8_block_scales"]
    eng = build_engine(block_art, store, BuildOptions(target="trtllm", verify=True))
    ckpt = eng.path / "trtllm"
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert facts["hf_quant_config"].items() <= q.items()
    assert q["group_size"] == BLOCK
    assert "lm_head" in q["exclude_modules"]
    assert eng.metrics["verify"]["passed"]
    assert eng.metrics["verify"]["max_rel_error"] == 0.0
    st, src = _tensors(ckpt), CheckpointReader(block_art.path)
    for i in range(2):
        for prefix, roles in FUSED + tuple((a.split(".")[0], (a.split(".")[1],)) for a in ALONE):
            names = [f"model.layers.{i}.{prefix}.{r}" for r in roles]
            for n in names:
                qw = src.linear(n).qw
                have = {k[len(n) + 1:]: t for k, t in st.items() if k.startswith(n + ".")}
                assert set(have) == set(facts["tensors"]), n
                for key, (dtype, shape) in facts["tensors"].items():
                    assert str(have[key].dtype) == f"torch.{dtype}", (n, key)
                    assert tuple(have[key].shape) == _shape(shape, *qw.shape), (n, key)
                assert torch.equal(have["weight"].view(torch.uint8), qw.q.view(torch.uint8))
                assert torch.equal(have["weight_scale"], qw.scale)
            # the fused linear as the loader assembles it computes each part's own blocks
            w = torch.cat([st[f"{n}.weight"] for n in names])
            scale = _loader_fused_scale([st[f"{n}.weight_scale"] for n in names], [st[f"{n}.weight"].shape[0]
                                                                                    for n in names])
            parts = torch.cat([_gemm_weight(st[f"{n}.weight"], st[f"{n}.weight_scale"]) for n in names])
            assert torch.equal(_gemm_weight(w, scale), parts)
            assert torch.equal(parts, torch.cat([src.linear(n).qw.dequantize() for n in names]))
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(2))
    assert torch.equal(llmq_logits(ckpt, ids), llmq_logits(block_art.path, ids))   # imported back: the same model


def test_fp8_block_parts_ending_inside_a_block_are_refused(store, tmp_path_factory):
    """q_proj of 3 heads x 64 = 192 rows ends inside a block: the loader would copy k_proj's scales to row block
    ceil(192 / 128) = 2, while the GEMM scales k's first 64 rows by block 1 (q's): wrong weights, so refused."""
    src = _model(store, tmp_path_factory, "block-bad", hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                 head_dim=64, intermediate_size=256)
    art = quantize(src, QuantizeOptions(method="fp8", group_size=128, probe_tokens=0), store, progress=False)
    ck = CheckpointReader(art.path)
    names = [f"model.layers.0.self_attn.{r}" for r in ("q_proj", "k_proj", "v_proj")]
    qws = [ck.linear(n).qw for n in names]
    scale = _loader_fused_scale([q.scale for q in qws], [q.shape[0] for q in qws])
    assert not torch.equal(_gemm_weight(torch.cat([q.q for q in qws]), scale),
                           torch.cat([q.dequantize() for q in qws]))
    engines = len(store.list(kind="engine"))
    with pytest.raises(LlmqError, match=r"q_proj: its 192 rows end inside a 128-row FP8 block") as e:
        build_engine(art, store, BuildOptions(target="trtllm"))
    assert "\n" not in str(e.value)
    assert len(store.list(kind="engine")) == engines


def test_what_the_loader_would_misread_in_a_layer_is_refused():
    """One quant_algo per fused group; FP8 block shards of whole blocks only."""
    def lw(out, inn):
        return LinearWeights("x", weight=torch.zeros(out, inn))

    block = {"quant_algo": "FP8_BLOCK_SCALES", "group_size": 128}
    lin = {"gate_proj": lw(384, 256), "up_proj": lw(384, 256), "down_proj": lw(256, 384)}
    check_backend_layer("model.layers.0.mlp", lin, {r: block for r in lin}, tp=1)
    with pytest.raises(LlmqError, match=r"mlp.gate_proj: 384 rows do not cut into whole 128-wide FP8 blocks for 2"):
        check_backend_layer("model.layers.0.mlp", lin, {r: block for r in lin}, tp=2)
    with pytest.raises(LlmqError, match=r"loads gate_proj / up_proj as one fused linear .* W8A16, None"):
        check_backend_layer("model.layers.0.mlp", lin, {"gate_proj": {"quant_algo": "W8A16"}, "up_proj": None}, tp=1)


def test_a_split_fused_group_is_refused_before_anything_is_written(store, tmp_path_factory):
    """gate_proj INT4 and up_proj 16-bit: TensorRT-LLM would build the fused gate_up linear unquantized (any part
    excluded excludes it) and load INT4 codes into it."""
    src = _model(store, tmp_path_factory, "split")
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=64, probe_tokens=0,
                                        ignore=("lm_head", "model.layers.1.mlp.up_proj")), store, progress=False)
    with pytest.raises(LlmqError, match=r"^model.layers.1: TensorRT-LLM loads gate_proj / up_proj as one fused"):
        build_engine(art, store, BuildOptions(target="trtllm"))


@pytest.fixture(scope="module")
def mixed_art(store, tmp_path_factory):
    """`--target-bpw` on a tiny model: units at INT8, INT4 per channel and in groups of 64, and one left 16-bit."""
    src = _model(store, tmp_path_factory, "mixed")
    return quantize(src, QuantizeOptions(method="rtn", target_bpw=7, probe_tokens=64,
                                         ignore=("lm_head", "model.layers.0.mlp.down_proj")), store, progress=False)


def _layer_config(layers: dict, module: str, fused: str | None) -> dict | None:
    """apply_layerwise_quant_config's lookup: a fused linear takes the first key containing its first part's name."""
    if fused is None:
        return layers.get(module)
    return next((v for k, v in layers.items() if fused in k), None)


def test_mixed_precision_checkpoint_is_what_the_loader_reads(store, mixed_art):
    facts = FACTS["mixed_precision"]
    ck = CheckpointReader(mixed_art.path)
    qws = [ck.linear(f"model.layers.{i}.{a}").qw for i in range(2) for a in LINEARS]
    assert len({qw and qw.scheme for qw in qws}) == 4   # INT8, INT4, INT4 g64, 16-bit: or this test checks little
    eng = build_engine(mixed_art, store, BuildOptions(target="trtllm", verify=True))
    ckpt = eng.path / "trtllm"
    assert eng.metrics["verify"]["passed"]
    assert eng.metrics["verify"]["max_rel_error"] == 0.0
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    per_layer = json.loads((ckpt / facts["per_layer_file"]).read_text())
    assert facts["hf_quant_config"].items() <= q.items()
    assert per_layer["quant_algo"] == q["quant_algo"]
    layers = per_layer[facts["per_layer_key"]]
    assert layers == q[facts["per_layer_key"]]
    assert "lm_head" in q["exclude_modules"]
    st = _tensors(ckpt)
    for i in range(2):
        units = [(f"model.layers.{i}.{p}", roles) for p, roles in FUSED] + \
            [(f"model.layers.{i}.{a.split('.')[0]}", (a.split(".")[1],)) for a in ALONE]
        for prefix, roles in units:
            fused = f"{prefix}.{roles[0]}" if len(roles) > 1 else None
            want = _layer_config(layers, f"{prefix}.{roles[0]}", fused)
            for r in roles:
                name, qw = f"{prefix}.{r}", ck.linear(f"{prefix}.{r}").qw
                entry = layers.get(name)
                assert entry == want, name   # the backend's one config for the fused linear is each part's own
                if qw is None:
                    assert name in q["exclude_modules"]
                    assert st[f"{name}.weight"].dtype == torch.float32
                    continue
                algo = entry["quant_algo"]
                assert set(entry) == {"quant_algo", *facts["entry_fields"][algo]}, name
                w, s = st[f"{name}.weight"], st[f"{name}.weight_scale"]
                out, inn = qw.shape
                assert w.dtype == torch.int8
                assert tuple(w.shape) == ((out, inn) if algo == "W8A16" else (out // 2, inn))
                assert tuple(s.shape) == ((out, inn // entry["group_size"]) if algo == "W4A16_AWQ" else (out,))
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(3))
    assert torch.equal(llmq_logits(ckpt, ids), llmq_logits(mixed_art.path, ids))   # imported back: the same model
