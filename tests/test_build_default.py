"""llmq build on the default model (SmolLM2-135M, 9 query / 3 KV heads): tp 2 with both targets, proven by the check."""

from __future__ import annotations

import json

import pytest

from llmq.errors import LlmqError
from llmq.pipeline.targets import BuildOptions, build_engine
from llmq.pipeline.targets.verify import TOLERANCE

pytestmark = pytest.mark.integration


def test_default_model_refuses_tp2_only_when_padding_is_turned_off(default_model, default_store):
    with pytest.raises(LlmqError, match="9 attention heads / 3 KV heads.*--no-pad-heads"):
        build_engine(default_model, default_store, BuildOptions(tp=2, pad_heads=False))


@pytest.mark.parametrize("target,weights", [("llmq", "bf16"), ("llmq", "int8"), ("trtllm", "bf16"), ("trtllm", "int8"),
                                            ("trtllm", "int4")])   # llmq INT4 tp 2, verified: the quickstart's test
def test_default_model_tp2(request, default_store, weights, target):
    source = request.getfixturevalue({"bf16": "default_model", "int8": "default_int8", "int4": "default_int4"}[weights])
    art = build_engine(source, default_store, BuildOptions(tp=2, target=target, verify=True))  # pads by default
    v = art.metrics["verify"]
    assert v["passed"]
    assert v["max_rel_error"] < TOLERANCE
    engine = json.loads((art.path / "engine.json").read_text())
    assert engine["plan"]["padded_heads"] == 12
    assert engine["plan"]["heads_per_rank"] == 6
    if target == "trtllm":
        qfile = art.path / "trtllm/hf_quant_config.json"
        algo = json.loads(qfile.read_text())["quantization"]["quant_algo"] if qfile.is_file() else None
        assert algo == {"bf16": None, "int8": "W8A16", "int4": "W4A16_AWQ"}[weights]
