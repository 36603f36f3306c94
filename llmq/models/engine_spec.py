"""engine.json: the one typed, versioned record of what `llmq build` wrote, read back by the runtime, the reference
check and every export writer, and validated on load so an engine written by another version fails in one line."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LlmqError

if TYPE_CHECKING:
    from .sharding import ShardPlan

FORMAT = "llmq-engine"
NATIVE = "llmq"   # the target the bundled runtime loads: build's default, named without a suffix
VERSION = 2   # 2: typed record; target-specific fields under "outputs" (1 had them at the top level)


@dataclass(frozen=True)
class EngineSpec:
    target: str                      # llmq | trtllm | gguf
    tp: int
    pp: int
    max_batch_size: int
    max_seq_len: int
    kv_cache_dtype: str              # auto | int8 | fp8
    block_size: int
    dtype: str                       # the checkpoint's dense dtype, e.g. bfloat16
    source: dict                     # {id, name, kind} of the artifact it was built from
    source_ids: list[str]            # that artifact's id and its parents'
    plan: ShardPlan
    ranks: list[str] = field(default_factory=list)   # per-rank directories / files, where the target has ranks
    quantization: dict | None = None                  # the weights' quantization_config, as the ranks carry it
    outputs: dict = field(default_factory=dict)       # what the target's writer recorded (checkpoint dir, compile...)

    @property
    def native(self) -> bool:
        """Whether the bundled runtime loads this engine (the other targets' engines run elsewhere)."""
        return self.target == NATIVE

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"format": FORMAT, "format_version": VERSION, **d, "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, where: str = "engine.json") -> "EngineSpec":
        from .sharding import ShardPlan  # here, not above: the build registry imports NATIVE without torch

        if d.get("format") != FORMAT:
            raise LlmqError(f"{where}: not an llmq engine record (format {d.get('format')!r})")
        if d.get("format_version") != VERSION:
            raise LlmqError(f"{where}: engine format version {d.get('format_version')} was written by another llmq; "
                            f"this one reads version {VERSION}: rebuild it with `llmq build`")
        names = {f.name for f in dataclasses.fields(cls)}
        body = {k: v for k, v in d.items() if k not in ("format", "format_version")}
        if missing := {f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING} - set(body):
            raise LlmqError(f"{where}: engine record lacks {sorted(missing)}")
        if unknown := set(body) - names:
            raise LlmqError(f"{where}: engine record has unknown fields {sorted(unknown)}")
        try:
            return cls(**(body | {"plan": ShardPlan.from_dict(body["plan"])}))
        except (KeyError, TypeError) as e:
            raise LlmqError(f"{where}: engine record's plan is malformed ({e})") from None

    def write(self, engine_dir: Path) -> None:
        (engine_dir / "engine.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, engine_dir: Path) -> "EngineSpec":
        path = Path(engine_dir) / "engine.json"
        try:
            return cls.from_dict(json.loads(path.read_text()), str(path))
        except FileNotFoundError:
            raise LlmqError(f"{engine_dir}: no engine.json (not an engine artifact)") from None
        except json.JSONDecodeError as e:
            raise LlmqError(f"{path}: not valid JSON ({e})") from None
