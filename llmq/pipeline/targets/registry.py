"""The export targets: one registry line each, and the one shape every target module declares.

A line names the target and its module and says in one phrase what it writes: the `--target` choices, their help
and the recipe's `target:` values come from these lines without importing the module (the CLI reads them without
torch). The module itself declares `TARGET`, an `ExportTarget`: what it refuses before anything is written, its
writer (one `TargetResult`) and its reader for `--verify`. The build stage and the reference check look a target up
here and never branch on its name, so a new target is its module, its line below and its tests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ...errors import LlmqError
from ...models.engine_spec import NATIVE

if TYPE_CHECKING:
    from pathlib import Path

    from ...models.engine_spec import EngineSpec
    from ...models.reader import CheckpointReader
    from ...models.sharding import RankWeights, ShardPlan


@dataclass(frozen=True)
class TargetLine:
    name: str       # the --target value
    module: str     # the module that declares TARGET (relative names are under this package)
    help: str       # what it writes, for --target's help


TARGETS: dict[str, TargetLine] = {line.name: line for line in (
    TargetLine(NATIVE, ".llmq_target", "rank shards for the bundled runtime"),
    TargetLine("trtllm", ".trtllm", "a ModelOpt-style HF checkpoint + LLM-API options for TensorRT-LLM "
                                    "(trtllm-serve, its PyTorch backend)"),
    TargetLine("gguf", ".gguf_target", "one .gguf file for llama.cpp / Ollama"),
)}


@dataclass(frozen=True)
class TargetResult:
    """What a writer produced, as engine.json records it."""

    outputs: dict                                     # the record's `outputs` (checkpoint dir, compile step, ...)
    ranks: list[str] = field(default_factory=list)    # per-rank directories / files, where the target has ranks
    quantization: dict | None = None                  # the weights' quantization config, as the ranks carry it

    @property
    def compile(self) -> dict:
        return self.outputs.get("compile", {"status": "not-applicable"})


@dataclass(frozen=True)
class ReadBack:
    """An engine's weights read back for the reference check (`verify.verify_engine`)."""

    ranks: list[RankWeights]       # as stored, per rank
    plan: ShardPlan                # the split they follow (an unsharded checkpoint: one rank)
    # where the target re-rounds at load: the ranks as it computes with them (None: as stored)
    computes: list[RankWeights] | None = None
    # the target runs elsewhere than llmq's runtime: verify records the KLD of what it computes against what llmq
    # evaluated
    foreign: bool = True


def _nothing(*_) -> None:
    return None


@dataclass(frozen=True)
class ExportTarget:
    """One target, declared once in its module as `TARGET`."""

    name: str
    # (src, plan, engine dir, the EngineSpec being written) -> TargetResult; the writer picks its own files there
    write: Callable[[CheckpointReader, ShardPlan, Path, EngineSpec], TargetResult]
    # (engine dir, its EngineSpec) -> ReadBack; None where --verify has nothing to check (`no_verify` says why)
    read_back: Callable[[Path, EngineSpec], ReadBack] | None
    # refusals that need the source's config but no weights, run before the engine directory exists
    refuse: Callable[[CheckpointReader, EngineSpec], None] = _nothing
    no_verify: str = ""
    # (the source, its model, held-out tokens) -> the probe's KLD of what the target's engine computes, modelled,
    # beside llmq's runtime on the same tokens; None where the engine computes what llmq's runtime does
    quality: Callable[[CheckpointReader, CheckpointReader, int], dict] | None = None

    def check_verify(self, verify: bool) -> None:
        """Refuse `build --verify` where the target has no read-back to check."""
        if verify and self.read_back is None:
            raise LlmqError(self.no_verify)


def target(name: str) -> ExportTarget:
    """The registered target `name`, its module imported on first use."""
    line = TARGETS.get(name)
    if line is None:
        raise LlmqError(f"unknown build target {name!r}; llmq knows {', '.join(TARGETS)}")
    declared = importlib.import_module(line.module, __package__).TARGET
    assert declared.name == name, f"{line.module} declares target {declared.name!r}, registered as {name!r}"
    return declared
