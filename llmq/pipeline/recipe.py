"""`llmq run RECIPE.yaml`: the whole pipeline from one file, validated up front, skipping unchanged stages.

A stage is skipped when an artifact already exists for the same (stage, parent artifact id, stage config): the
runner keeps that mapping in `<store>/.recipes/stages/<key>` (a cache beside the artifacts, never inside them), and
re-verifies the artifact it points to before reusing it. Changing one stage's settings changes its key and so the
parent id of every later stage: those re-run, earlier ones do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args, get_origin, get_type_hints

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)

from ..artifacts import Artifact, ArtifactError, Store
from ..bench.offline import OfflineOptions
from ..errors import LlmqError
from ..evals.runner import EvalOptions
from ..options import default_of, user_fields
from ..report.options import ReportOptions
from .kv_options import KVOptions
from .quantize import QuantizeOptions
from .targets import BuildOptions

STAGES = {"quantize": QuantizeOptions, "quantize_kv": KVOptions, "build": BuildOptions, "eval": EvalOptions,
          "bench": OfflineOptions, "report": ReportOptions}
STAGE_ORDER = tuple(STAGES)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageConfig(_Strict):
    """A recipe stage: the keys are the fields of the stage's options dataclass (`options`), with the same names,
    defaults, choices and bounds; the dataclass's own check() judges the combination."""

    options: ClassVar[type]

    @model_validator(mode="after")
    def _checked(self):
        try:
            self.to_options().check()
        except LlmqError as e:
            raise ValueError(str(e)) from None
        return self

    def to_options(self, **defaults):
        """The stage's options: the keys the recipe sets, else `defaults` (the runner's seed and name), else the
        dataclass's defaults."""
        return self.options(**{**defaults, **self.model_dump(exclude_unset=True)})


def _no_bool(value):
    """YAML's true/false are ints to pydantic (and True == 1 passes a Literal[1, 2]): refuse them where an option
    is not a switch, so `tp: true` is an error and not one rank."""
    if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(x, bool) for x in value)):
        raise ValueError(f"{str(value).lower()} is a yes/no, this option takes a value")
    return value


def _on_off(value):
    """YAML 1.1 reads a bare on / off as true / false: an option whose choices are those words gets them back."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def _takes_bool(hint) -> bool:
    return hint is bool or bool in get_args(hint)


def _pydantic_field(f: dataclasses.Field, hint) -> tuple:
    """(type, FieldInfo) of one option: choices become a Literal, bounds apply to every item of a list, former
    names are accepted as aliases, yes/no only where the option is a switch."""
    meta = f.metadata
    switch = _takes_bool(hint)
    bounds = dict(meta["bounds"])
    if meta["choices"]:
        hint = Literal[meta["choices"]] | None if default_of(f) is None else Literal[meta["choices"]]
    elif get_origin(hint) is list and bounds:
        hint, bounds = list[Annotated[get_args(hint)[0], Field(**bounds)]], {}
    if f.default_factory is not dataclasses.MISSING:
        bounds["default_factory"] = f.default_factory
    elif f.default is not dataclasses.MISSING:
        bounds["default"] = f.default
    alias = AliasChoices(f.name, *meta["aliases"]) if meta["aliases"] else None
    if not switch:
        words = {"on", "off"} <= set(meta["choices"] or ())
        hint = Annotated[hint, BeforeValidator(_on_off if words else _no_bool)]
    return hint, Field(min_length=meta["min_items"], validation_alias=alias, **bounds)


def stage_config(cls: type) -> type[StageConfig]:
    """The recipe stage of an options dataclass."""
    hints = get_type_hints(cls)
    model = create_model(f"{cls.__name__.removesuffix('Options')}Stage", __base__=StageConfig,
                         **{f.name: _pydantic_field(f, hints[f.name]) for f in user_fields(cls)})
    model.options = cls
    return model


QuantizeStage, QuantizeKVStage, BuildStage, EvalStage, BenchStage, ReportStage = map(stage_config, STAGES.values())


class Stages(_Strict):
    quantize: QuantizeStage | None = None
    quantize_kv: QuantizeKVStage | None = Field(None, alias="quantize-kv")
    build: BuildStage | None = None
    eval: EvalStage | None = None
    bench: BenchStage | None = None
    report: ReportStage | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _no_serve(cls, data):
        if isinstance(data, dict) and "serve" in data:
            raise ValueError("serve is not a recipe stage (a recipe produces artifacts); serve the engine it builds "
                             "with `llmq serve REF`")
        return data


class Recipe(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: str | None = None
    description: str | None = None
    seed: int = Field(0, strict=True)
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


MAX_DEPTH = 64  # nesting a recipe may use (a real one uses 4); deeper is refused before Python's recursion limit


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing what it would take silently or die on: a key given twice in one mapping (the
    last one won) and nesting deeper than MAX_DEPTH (a RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if (key.tag, key.value) in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key.value!r} given twice (line {key.start_mark.line + 1})", key.start_mark)
                seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate the whole recipe before anything runs; errors name the offending key."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), _RecipeLoader)  # noqa: S506 (a safe loader)
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
