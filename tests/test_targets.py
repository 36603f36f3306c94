"""The target registry: a target registered by its line alone is written, recorded and verified by the build stage.

This module declares a toy target (llmq's rank shards under a directory of its own, read back by its own reader)
and registers it in a test: nothing in the stage or the reference check names it, so if either branched on target
names instead of asking the registry, these tests fail.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import types

import pytest
import torch

from llmq.errors import GateFailed, LlmqError
from llmq.models import resolve_model
from llmq.models.reader import CheckpointReader
from llmq.pipeline.targets import BuildOptions, build_engine, registry
from llmq.pipeline.targets.llmq_target import write_llmq
from llmq.pipeline.targets.registry import ExportTarget, ReadBack, TargetLine, TargetResult
from llmq.pipeline.targets.verify import exact, reference_weights


def _write(src, plan, engine_dir, engine) -> TargetResult:
    inner = write_llmq(src, plan, engine_dir / "toy", engine)
    return TargetResult({"toy_ranks": [f"toy/{d}" for d in inner.ranks], "compile": {"status": "toy-compiled"}})


def _read_back(engine_dir, engine) -> ReadBack:
    ranks = [reference_weights(CheckpointReader(engine_dir / d), exact) for d in engine.outputs["toy_ranks"]]
    return ReadBack(ranks=ranks, plan=engine.plan)


TARGET = ExportTarget("toy", write=_write, read_back=_read_back)


@pytest.fixture
def toy(monkeypatch, make_tiny_model, store, tmp_path):
    """The toy target registered by one line (this module), and a tiny model to build. --target's choices are read
    from the registry when BuildOptions is defined; they are re-read here, after the line is added."""
    monkeypatch.setitem(registry.TARGETS, "toy", TargetLine("toy", __name__, "a test target"))
    field = copy.copy(BuildOptions.__dataclass_fields__["target"])
    field.metadata = types.MappingProxyType({**field.metadata, "choices": tuple(registry.TARGETS)})
    monkeypatch.setitem(BuildOptions.__dataclass_fields__, "target", field)
    return store, resolve_model(str(make_tiny_model(tmp_path / "tiny")), store)


def test_a_registered_target_is_written_recorded_and_verified_through_the_registry(toy):
    store, source = toy
    art = build_engine(source, store, BuildOptions(target="toy", tp=2, verify=True))
    engine = json.loads((art.path / "engine.json").read_text())
    assert engine["target"] == "toy"
    assert art.name.endswith("-tp2-toy")
    assert engine["outputs"] == {"toy_ranks": ["toy/rank0", "toy/rank1"], "compile": {"status": "toy-compiled"}}
    assert engine["ranks"] == []
    assert engine["quantization"] is None
    assert art.metrics["compile"] == {"status": "toy-compiled"}
    v = art.metrics["verify"]
    assert v["passed"]
    assert v["target"] == "toy"
    assert v["tp"] == 2
    assert v["target_kld"] < 1e-3
    assert v["target_top1"] == 1.0   # it computes what llmq evaluated


def test_the_reference_check_uses_the_targets_own_reader(toy, monkeypatch):
    store, source = toy

    def swapped(engine_dir, engine):   # ranks read back in the wrong order: heads land on the wrong rank
        back = _read_back(engine_dir, engine)
        return dataclasses.replace(back, ranks=back.ranks[::-1])
    monkeypatch.setattr(sys.modules[__name__], "TARGET", dataclasses.replace(TARGET, read_back=swapped))
    with pytest.raises(GateFailed, match=r"reference check failed.*target=toy"):
        build_engine(source, store, BuildOptions(target="toy", tp=2, verify=True))
    assert store.list("engine") == []


def test_a_targets_refusals_run_before_anything_is_written(toy, monkeypatch):
    store, source = toy

    def refuse(src, engine):
        raise LlmqError(f"toy refuses tp={engine.tp}")
    monkeypatch.setattr(sys.modules[__name__], "TARGET", dataclasses.replace(TARGET, refuse=refuse))
    with pytest.raises(LlmqError, match="toy refuses tp=2"):
        build_engine(source, store, BuildOptions(target="toy", tp=2))
    monkeypatch.setattr(sys.modules[__name__], "TARGET", dataclasses.replace(TARGET, read_back=None,
                                                                            no_verify="toy has nothing to verify"))
    with pytest.raises(LlmqError, match="toy has nothing to verify"):
        BuildOptions(target="toy", verify=True).check()
    assert store.list("engine") == []


def test_target_choices_come_from_the_registry_and_each_module_declares_its_line():
    from llmq.cli.main import cli

    param = next(p for p in cli.commands["build"].params if p.name == "target")
    assert tuple(param.type.choices) == tuple(registry.TARGETS)
    assert [registry.target(n).name for n in registry.TARGETS] == list(registry.TARGETS)
    with pytest.raises(LlmqError, match="drop --verify"):
        BuildOptions(target="gguf", verify=True).check()
    with pytest.raises(LlmqError, match="unknown build target 'nope'"):
        registry.target("nope")


def test_the_kv_scale_convention_counts_what_a_rank_holds_wrongly():
    from llmq.models import ModelSpec
    from llmq.models.sharding import make_plan
    from llmq.pipeline.targets.verify import kv_scale_mismatches

    cfg = dict(model_type="llama", num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=320)
    plan = make_plan(ModelSpec.from_config(cfg), 2)
    k, v = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.25])   # per KV head; rank r holds KV head r
    src = types.SimpleNamespace(spec=types.SimpleNamespace(num_layers=1), kv_scales=lambda i: (k, v))
    unscaled = types.SimpleNamespace(spec=src.spec, kv_scales=lambda i: None)
    rank = lambda *kv: types.SimpleNamespace(kv_scales=[kv] if kv else [])  # noqa: E731
    sliced = [rank(k[:1], v[:1]), rank(k[1:], v[1:])]
    assert kv_scale_mismatches(sliced, src, plan) == 0                     # llmq's: K and V, sliced by head
    assert kv_scale_mismatches(sliced[::-1], src, plan) == 2               # each rank holds the other's heads
    assert kv_scale_mismatches([rank(), sliced[1]], src, plan) == 1        # missing
    assert kv_scale_mismatches(sliced, unscaled, plan) == 2                # scales the source does not have
