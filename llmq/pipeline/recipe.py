"""`llmq run RECIPE.yaml`: the whole pipeline from one file, validated up front, skipping unchanged stages.

A stage is skipped when an artifact already exists for the same (stage, parent artifact id, stage config): the
runner keeps that mapping in `<store>/.recipes/stages/<key>` (a cache beside the artifacts, never inside them), and
re-verifies the artifact it points to before reusing it. Changing one stage's settings changes its key and so the
parent id of every later stage: those re-run, earlier ones do not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..artifacts import Artifact, ArtifactError, Store
from ..errors import LlmqError

STAGE_ORDER = ("quantize", "quantize_kv", "build", "eval", "bench")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantizeStage(_Strict):
    bits: Literal[4, 8]
    method: Literal["rtn", "gptq", "awq", "smoothquant", "fp8"] = "rtn"
    group_size: int | None = Field(None, ge=0)   # None: the default for the bits; 0: per channel
    symmetric: bool = True
    act_order: bool = False
    alpha: float | None = Field(None, gt=0, le=1)
    calib: str | None = None
    calib_samples: int = Field(32, gt=0)
    name: str | None = None

    @model_validator(mode="after")
    def _method_supports_bits(self):
        if self.method in ("smoothquant", "fp8") and self.bits != 8:
            raise ValueError(f"method {self.method} quantizes to 8 bits; set bits: 8")
        if self.alpha is not None and self.method != "smoothquant":
            raise ValueError("alpha is SmoothQuant's migration strength; it needs method: smoothquant")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order is a GPTQ option; it needs method: gptq")
        return self


class QuantizeKVStage(_Strict):
    kv: Literal["int8", "fp8"]
    calib: str | None = None
    name: str | None = None


class BuildStage(_Strict):
    tp: Literal[1, 2, 4, 8] = 1
    target: Literal["llmq", "trtllm", "trtllm-hf", "gguf"] = "llmq"
    max_batch_size: int = Field(64, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    kv: Literal["auto", "int8", "fp8"] = "auto"
    block_size: int = Field(16, gt=0)
    pad_heads: bool = True
    parallel_embedding: bool = False
    verify: bool = False
    name: str | None = None


class EvalStage(_Strict):
    tasks: list[str] = Field(default_factory=lambda: ["code", "math"], min_length=1)
    limit: int | None = Field(None, gt=0)
    gate: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _gates_parse_and_have_their_scores(self):
        from ..evals.gate import KLD_NAMES, parse_gates

        try:
            gates = parse_gates(self.gate)
        except LlmqError as e:
            raise ValueError(str(e)) from None
        if any(g.name in KLD_NAMES for g in gates) and "kld" not in self.tasks:
            raise ValueError("a kld / kld_p99 / top1 gate needs kld in tasks")
        return self


class BenchStage(_Strict):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    input_len: int = Field(128, gt=0)
    output_len: int = Field(128, gt=0)
    name: str | None = None


class ServeStage(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)


class Stages(_Strict):
    quantize: QuantizeStage | None = None
    quantize_kv: QuantizeKVStage | None = Field(None, alias="quantize-kv")
    build: BuildStage | None = None
    eval: EvalStage | None = None
    bench: BenchStage | None = None
    serve: ServeStage | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Recipe(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: str | None = None
    description: str | None = None
    seed: int = 0
    stages: Stages

    @model_validator(mode="after")
    def _combinations(self):
        s = self.stages
        if not any(getattr(s, n) for n in STAGE_ORDER):
            raise ValueError("stages: name at least one of " + ", ".join(STAGE_ORDER))
        if s.build and s.build.kv == "int8" and not s.quantize_kv:
            raise ValueError("stages.build.kv: int8 needs calibrated KV scales; add a quantize-kv stage with kv: int8")
        if s.build and s.quantize_kv and s.build.kv not in ("auto", s.quantize_kv.kv):
            raise ValueError(f"stages.build.kv: {s.build.kv} contradicts stages.quantize-kv.kv: {s.quantize_kv.kv}")
        return self


def _format_error(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {first['msg']}{more}"


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate the whole recipe before anything runs; errors name the offending key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise LlmqError(f"{path}: recipe not found") from None
    except yaml.YAMLError as e:
        raise LlmqError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise LlmqError(f"{path}: a recipe is a mapping with name, model and stages")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise LlmqError(_format_error(path, e)) from None


def stage_key(stage: str, parent: Artifact, config: BaseModel, extra: dict | None = None) -> str:
    payload = {"stage": stage, "parent": parent.id, "config": config.model_dump(mode="json"), "extra": extra or {}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class StageCache:
    """(stage, parent id, config) -> artifact id, kept beside the store's artifacts."""

    def __init__(self, store: Store):
        self.store = store
        self.dir = store.root / ".recipes" / "stages"

    def get(self, key: str) -> Artifact | None:
        f = self.dir / key
        if not f.is_file():
            return None
        try:
            return self.store.by_id(f.read_text().strip())
        except ArtifactError:
            return None

    def put(self, key: str, art: Artifact) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{key}.tmp"
        tmp.write_text(art.id)
        tmp.replace(self.dir / key)
