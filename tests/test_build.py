"""llmq build: the sharding plan, both targets, and the reference check that proves the split (tiny models)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from llmq.errors import GateFailed, LlmqError
from llmq.models import ModelSpec, resolve_model
from llmq.models.reader import CheckpointReader
from llmq.models.sharding import HeadSplitError, LinearWeights, split_cols, split_rows
from llmq.pipeline.targets import BuildOptions, build_engine, make_plan
from llmq.pipeline.targets.verify import (
    TOLERANCE,
    max_rel_error,
    reference_weights,
    run_plan,
    verify_engine,
)
from llmq.quant import pack_int4_rows, unpack_int4_rows


def spec(heads=4, kv=2, **kw) -> ModelSpec:
    cfg = dict(model_type="llama", num_hidden_layers=2, hidden_size=16 * heads, num_attention_heads=heads,
               num_key_value_heads=kv, intermediate_size=128, vocab_size=320)
    return ModelSpec.from_config(cfg | kw)


# ---- the plan -----------------------------------------------------------------------------------------------------

def test_tp_that_does_not_divide_the_heads_is_refused_with_the_way_out():
    with pytest.raises(HeadSplitError, match=r"^tp 2 does not divide this model's 9 attention heads / 3 KV heads "
                                             r"\(tp values that do: 1\)$") as e:
        make_plan(spec(heads=9, kv=3), 2, pad_heads=False)
    assert e.value.padded == (12, 4)   # what padding would give: build's refusal offers it (its --pad-heads)
    with pytest.raises(LlmqError, match="use one of 1, 2, 4, 8"):
        make_plan(spec(), 3)
    with pytest.raises(LlmqError, match="MLP width 130"):
        make_plan(spec(intermediate_size=130), 4)


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_each_kv_head_next_to_its_queries():
    plan = make_plan(spec(heads=4, kv=2), 4)
    assert [plan.q_heads(r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [plan.kv_heads(r) for r in range(4)] == [[0], [0], [1], [1]]   # query head h uses kv head h // 2
    assert plan.kv_replicas == 2
    assert plan.kv_heads_per_rank == 1
    plan = make_plan(spec(heads=8, kv=1), 8)                                   # MQA
    assert all(plan.kv_heads(r) == [0] for r in range(8))


def test_padded_heads_are_whole_zero_groups_after_the_real_heads():
    plan = make_plan(spec(heads=9, kv=3), 2, pad_heads=True)
    assert (plan.padded_heads, plan.padded_kv_heads) == (12, 4)
    assert plan.q_heads(0) == [0, 1, 2, 3, 4, 5]
    assert plan.q_heads(1) == [6, 7, 8, None, None, None]
    assert plan.kv_heads(0) == [0, 1]
    assert plan.kv_heads(1) == [2, None]
    rows = plan.q_rows(1)
    assert rows[:48].tolist() == list(range(6 * 16, 9 * 16))
    assert (rows[48:] == -1).all()


def test_vocab_is_padded_to_a_multiple_of_tp():
    plan = make_plan(spec(vocab_size=321), 4)
    assert plan.padded_vocab_size == 324
    assert plan.vocab_rows(3).tolist() == [243 + i for i in range(78)] + [-1, -1, -1]


@dataclasses.dataclass
class _Grouped:
    """The fields of a quantized weight that slicing touches (qformat.QuantizedWeight has these and more)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None

    def dequantize(self, dtype=torch.float32):
        g = self.q.shape[1] // self.scale.shape[1]
        return ((self.q.float() - self.zero_point.float().repeat_interleave(g, 1))
                * self.scale.float().repeat_interleave(g, 1)).to(dtype)


def test_group_scales_follow_their_columns_and_a_split_through_a_group_is_refused():
    gen = torch.Generator().manual_seed(0)
    qw = _Grouped(q=torch.randint(-8, 8, (4, 8), generator=gen, dtype=torch.int8),
                  scale=torch.rand(4, 2, generator=gen) + 0.5, zero_point=torch.randint(-8, 8, (4, 2), generator=gen))
    lw = LinearWeights("m", qw=qw)
    full = lw.dense()
    right = split_cols(lw, torch.arange(4, 8))            # the second group of every row
    assert torch.equal(right.qw.scale, qw.scale[:, 1:])
    assert torch.equal(right.dense(), full[:, 4:])
    padded = split_cols(lw, torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]))
    assert torch.equal(padded.dense(), torch.cat([full[:, :4], torch.zeros(4, 4)], 1))
    rows = split_rows(lw, torch.tensor([2, -1]))           # a real row and a padding row
    assert torch.equal(rows.dense(), torch.stack([full[2], torch.zeros(8)]))
    with pytest.raises(LlmqError, match="cuts through 4-column quantization groups"):
        split_cols(lw, torch.arange(2, 6))
    with pytest.raises(LlmqError, match="not a whole number of 4-column quantization groups"):
        split_cols(lw, torch.arange(0, 6))


# ---- the reference forward itself ---------------------------------------------------------------------------------

def test_reference_forward_matches_transformers(make_tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    for i, kw in enumerate([{}, {"model_type": "qwen2", "tie_word_embeddings": True}]):
        d = make_tiny_model(tmp_path / f"m{i}", seed=i, **kw)
        src = CheckpointReader(d)
        ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            ours = run_plan([reference_weights(src)], make_plan(src.spec, 1), src.config, ids)
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits
        assert max_rel_error(ours, hf) < 1e-5


# ---- build + reference check, both targets ------------------------------------------------------------------------

SHAPES = {
    "gqa": {},                                                          # 4 heads / 2 KV: tp 4 replicates KV heads
    "tied-odd-vocab": {"tie_word_embeddings": True, "vocab_size": 321},
    "qwen2-bias": {"model_type": "qwen2"},
    "pad-6-3": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
}


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("build")
    store = Store(root / "store")
    return store, {k: resolve_model(str(tiny_model(seed=i, name=k, **kw)), store)
                   for i, (k, kw) in enumerate(SHAPES.items())}


@pytest.mark.parametrize("target", ["llmq", "trtllm"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_reproduce_the_unsharded_logits(tiny_sources, shape, tp, target):
    store, sources = tiny_sources
    opts = BuildOptions(tp=tp, target=target, pad_heads=shape == "pad-6-3", parallel_embedding=tp == 2, verify=True)
    art = build_engine(sources[shape], store, opts)
    v = art.metrics["verify"]
    assert v["passed"]
    assert v["max_rel_error"] < TOLERANCE
    assert v["tp"] == (1 if target == "trtllm" else tp)   # trtllm-serve shards the padded checkpoint itself
    engine = json.loads((art.path / "engine.json").read_text())
    assert engine["source_ids"][0] == sources[shape].id
    assert engine["tp"] == tp
    assert engine["target"] == target
    assert {"max_batch_size", "max_seq_len", "kv_cache_dtype", "block_size", "pp"} <= set(engine)
    assert (art.path / "tokenizer.json").is_file()


# Groups of 64 (TensorRT-LLM's smallest): at tp 2 and 4 each rank holds part of a group and TensorRT-LLM's padding.
QUANTIZED = {"int8": dict(bits=8), "int4": dict(bits=4, group_size=64), "int4-asym": dict(bits=4, group_size=64,
                                                                                        symmetric=False),
             "int4-head8": dict(bits=4, group_size=64, lm_head="int8")}


@pytest.fixture(scope="module")
def quantized_sources(tiny_sources):
    """RTN artifacts of the GQA tiny model: INT8 per channel, INT4 in groups of 64 (symmetric and not)."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, sources = tiny_sources
    return store, {k: quantize(sources["gqa"], QuantizeOptions(method="rtn", **kw), store, progress=False)
                   for k, kw in QUANTIZED.items()}


@pytest.mark.parametrize("target", ["llmq", "trtllm"])
@pytest.mark.parametrize("quant", list(QUANTIZED))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_quantized_shards_reproduce_the_unsharded_logits(quantized_sources, quant, tp, target):
    store, sources = quantized_sources
    if target == "trtllm" and quant == "int4-asym":
        with pytest.raises(LlmqError, match="^asymmetric weights: .* without zero points"):
            build_engine(sources[quant], store, BuildOptions(tp=tp, target=target))
        return
    art = build_engine(sources[quant], store, BuildOptions(tp=tp, target=target, verify=True))
    v = art.metrics["verify"]
    assert v["passed"]
    assert v["max_rel_error"] < TOLERANCE
    if target == "trtllm":
        q = json.loads((art.path / "trtllm/hf_quant_config.json").read_text())["quantization"]
        assert q["quant_algo"] == {"int8": "W8A16", "int4": "W4A16_AWQ", "int4-head8": "W4A16_AWQ"}[quant]
        assert "lm_head" in q["exclude_modules"]
        if quant != "int8":
            assert q["group_size"] == 64
            assert q["has_zero_point"] is False
    else:
        rank = json.loads((art.path / "rank0/config.json").read_text())
        assert rank["quantization_config"]["format"] == "pack-quantized"


def test_tp8_with_a_single_kv_head(make_tiny_model, store, tmp_path):
    d = make_tiny_model(tmp_path / "mqa", num_attention_heads=8, num_key_value_heads=1)
    art = build_engine(resolve_model(str(d), store), store, BuildOptions(tp=8, target="trtllm", verify=True))
    assert art.metrics["verify"]["passed"]
    assert art.config["plan"]["kv_replicas"] == 8


def _writable_copy(art, tmp_path: Path) -> Path:
    d = tmp_path / "engine"
    shutil.copytree(art.path, d)
    for p in d.rglob("*"):
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return d


def _edit(path: Path, fn) -> None:
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def test_reference_check_catches_swapped_heads_and_wrong_kv_replication(tiny_sources, tmp_path):
    store, sources = tiny_sources
    art = build_engine(sources["gqa"], store, BuildOptions(tp=4, target="llmq"))
    src = sources["gqa"].path
    assert verify_engine(art.path, src)["passed"]

    d = _writable_copy(art, tmp_path / "a")    # rank 1 attends with KV head 1, which belongs to ranks 2 and 3
    other = load_file(str(d / "rank2/model.safetensors"))

    def wrong_kv(s):
        for k in ("k_proj", "v_proj"):
            s[f"model.layers.0.self_attn.{k}.weight"] = other[f"model.layers.0.self_attn.{k}.weight"]
    _edit(d / "rank1/model.safetensors", wrong_kv)
    bad = verify_engine(d, src)
    assert not bad["passed"]
    assert bad["max_rel_error"] > 100 * TOLERANCE

    art2 = build_engine(sources["gqa"], store, BuildOptions(tp=1, target="trtllm"))
    d = _writable_copy(art2, tmp_path / "b")   # query heads 0 and 1 swapped

    def swap_heads(s):
        w = s["model.layers.1.self_attn.q_proj.weight"]
        s["model.layers.1.self_attn.q_proj.weight"] = torch.cat([w[16:32], w[:16], w[32:]])
    _edit(next((d / "trtllm").glob("*.safetensors")), swap_heads)
    bad = verify_engine(d, src)
    assert not bad["passed"]
    assert bad["max_rel_error"] > 100 * TOLERANCE


def test_failed_reference_check_writes_nothing(tiny_sources, monkeypatch):
    store, sources = tiny_sources
    import llmq.models.sharding as shard

    real = shard.split_cols
    monkeypatch.setattr(shard, "split_cols", lambda lw, cols: real(lw, cols.flip(0)))   # o_proj/down columns reversed
    before = store.versions("gqa-broken")
    with pytest.raises(GateFailed, match="reference check failed"):
        build_engine(sources["gqa"], store, BuildOptions(tp=2, verify=True, name="gqa-broken"))
    assert store.versions("gqa-broken") == before


# ---- TensorRT-LLM specifics ---------------------------------------------------------------------------------------

def test_int4_packing_is_two_output_rows_per_byte_low_nibble_first():
    q = torch.tensor([[1, -8], [-1, 7], [3, 0], [-4, -2]], dtype=torch.int8)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int8
    assert packed.shape == (2, 2)
    assert packed.view(torch.uint8).tolist() == [[0xF1, 0x78], [0xC3, 0xE0]]
    assert torch.equal(unpack_int4_rows(packed), q)


# ---- the command ------------------------------------------------------------------------------------------------

@pytest.fixture
def cli():
    from llmq.cli.build import build
    from llmq.cli.main import cli as group

    group.add_command(build)
    return group


def test_cli_builds_and_refuses_clearly(cli, make_tiny_model, tmp_path):
    d = make_tiny_model(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    store = ["--store", str(tmp_path / "store")]
    r = CliRunner().invoke(cli, [*store, "build", str(d), "--tp", "2", "--no-pad-heads"])
    assert r.exit_code == 2
    assert "error: --tp 2 does not divide this model's 6 attention heads" in r.output
    assert "drop --no-pad-heads to add zero heads (exact, 8 heads / 4 KV heads)" in r.output
    r = CliRunner().invoke(cli, [*store, "build", str(d), "--tp", "2", "--pp", "2"])
    assert r.exit_code == 2
    assert "pipeline parallelism is not supported" in r.output
    r = CliRunner().invoke(cli, [*store, "build", str(d), "--tp", "2", "--verify", "--target", "trtllm"])
    assert r.exit_code == 0, r.output   # padding is the default: it is exact
    assert "padded from 6 / 3 to 8 / 4 heads with zero heads (exact)" in r.output
    assert "reference check: max relative error" in r.output
    assert "compile: pytorch-options" in r.output


def test_llm_api_options_carry_the_run_time_settings(tmp_path):
    import types

    import yaml

    from llmq.pipeline.targets.trtllm import write_llm_api_options

    engine = types.SimpleNamespace(tp=2, pp=1, max_batch_size=8, max_seq_len=1024, kv_cache_dtype="fp8")
    out = write_llm_api_options(tmp_path, engine)
    assert out["status"] == "pytorch-options"
    assert "--extra_llm_api_options" in out["serve_command"]
    opts = yaml.safe_load((tmp_path / "llm_api_options.yaml").read_text())
    assert opts["tensor_parallel_size"] == 2
    assert opts["kv_cache_config"] == {"dtype": "fp8"}
    assert opts["max_batch_size"] == 8
    assert opts["max_num_tokens"] >= 1024
