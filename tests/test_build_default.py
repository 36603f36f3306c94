"""llmq build on the default model (SmolLM2-135M, 9 query / 3 KV heads): tp 2 with both targets, proven by the check."""

from __future__ import annotations

import json

import pytest

from llmq.errors import LlmqError
from llmq.pipeline.build import BuildOptions, build_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(default_model):
    from llmq.artifacts import Store

    return Store(default_model.path.parent.parent)


def test_default_model_refuses_tp2_without_padding(default_model, store):
    with pytest.raises(LlmqError, match="9 attention heads / 3 KV heads.*--pad-heads"):
        build_engine(default_model, store, BuildOptions(tp=2))


@pytest.mark.parametrize("target", ["llmq", "trtllm"])
def test_default_model_bf16_tp2(default_model, store, target):
    art = build_engine(default_model, store, BuildOptions(tp=2, target=target, pad_heads=True, verify=True))
    v = art.metrics["verify"]
    assert v["passed"] and v["max_rel_error"] < 1e-4
    engine = json.loads((art.path / "engine.json").read_text())
    assert engine["plan"]["padded_heads"] == 12 and engine["plan"]["heads_per_rank"] == 6
