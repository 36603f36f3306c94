"""Running a validated recipe: each stage in order, reusing the artifact of any stage whose inputs are unchanged.

A stage's inputs are its parent artifact's content id and its own settings; `recipe.stage_key` hashes both. Because
every artifact's id is a hash of its payload and the stages are deterministic, an unchanged prefix of the pipeline
keeps its ids and a changed stage changes the parent id of everything after it: those re-run, nothing before does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..artifacts import Artifact, Store
from ..errors import LlmqError
from ..models import resolve_model
from ..models.engine_spec import NATIVE
from .recipe import STAGE_ORDER, Recipe, StageCache, stage_key


@dataclass
class StageResult:
    stage: str
    status: str                     # ran | reused | would run | would reuse
    artifact: Artifact | None
    seconds: float = 0.0
    summary: dict = field(default_factory=dict)


@dataclass
class RunResult:
    recipe: Recipe
    model: Artifact
    stages: list[StageResult]
    gates: list[tuple[str, bool]]   # (gate and what it measured, passed)

    @property
    def failed_gates(self) -> list[str]:
        return [g for g, passed in self.gates if not passed]


def _quantize(parent: Artifact, cfg, store: Store, recipe: Recipe) -> Artifact:
    from .quantize import quantize

    name = f"{recipe.name}-{cfg.method}" + (f"-w{cfg.bits}" if cfg.bits else "")
    return quantize(parent, cfg.to_options(seed=recipe.seed, name=name), store)


def _quantize_kv(parent: Artifact, cfg, store: Store, recipe: Recipe) -> Artifact:
    from .kvcache import quantize_kv

    return quantize_kv(parent, store, cfg.to_options(name=f"{recipe.name}-kv{cfg.kv}"))


def _build(parent: Artifact, cfg, store: Store, recipe: Recipe) -> Artifact:
    from .targets import build_engine

    suffix = "" if cfg.target == NATIVE else f"-{cfg.target}"
    return build_engine(parent, store, cfg.to_options(name=f"{recipe.name}-tp{cfg.tp}{suffix}"))


def _eval(parent: Artifact, cfg, store: Store, recipe: Recipe) -> Artifact:
    """Evaluate against the root model of the parent's lineage unless the stage names a baseline; gates are judged
    by the runner, not stored."""
    from ..evals.evaluate import pick_baseline, run_eval

    opts = cfg.to_options(seed=recipe.seed)
    if opts.endpoint:
        raise LlmqError("a recipe's eval stage evaluates the artifact before it; endpoint is `llmq eval`'s")
    return run_eval(store, parent, pick_baseline(store, parent, opts.baseline), opts.settings(store), gates=[],
                    name=opts.name).artifact


def _bench(parent: Artifact, cfg, store: Store, recipe: Recipe) -> Artifact:
    from ..bench import run_offline

    return run_offline(parent, cfg.to_options(seed=recipe.seed, name=f"{recipe.name}-bench"), store)


ADAPTERS: dict[str, Callable] = {"quantize": _quantize, "quantize_kv": _quantize_kv, "build": _build,
                                 "eval": _eval, "bench": _bench}


def _feeds_next(stage: str, cfg) -> bool:
    """Whether a stage's artifact is the input of the stages after it. eval and bench only read theirs, and a
    TensorRT-LLM checkpoint is for TensorRT-LLM: eval and bench after it read the build's source instead."""
    return stage in ("quantize", "quantize_kv") or (stage == "build" and cfg.target == NATIVE)


def _key(stage: str, parent: Artifact, cfg, recipe: Recipe) -> str:
    """A gate only judges the report, so changing it re-judges the cached report instead of re-running eval; the
    eval's task data is an input too, so a new version of it re-runs eval."""
    if stage != "eval":
        return stage_key(stage, parent, cfg, {"seed": recipe.seed})
    from ..evals.tasks import TASKS_VERSION

    return stage_key(stage, parent, cfg.model_copy(update={"gate": None}),
                     {"seed": recipe.seed, "tasks_version": TASKS_VERSION})


def _gates(report: Artifact, gate: str | None) -> list[tuple[str, bool]]:
    """Every gate of `gate` judged on `report`: (the gate with the value it saw, passed)."""
    if not gate:
        return []
    import json

    from ..evals.gate import check_gates, parse_gates
    from ..evals.report import REPORT_JSON

    results = check_gates(parse_gates(gate), json.loads(report.file(REPORT_JSON).read_text()))
    return [(f"{r.gate} ({r.what})", r.passed) for r in results]


def _report(subject: Artifact, cfg, store: Store, recipe: Recipe, made: list[Artifact], dry_run: bool,
            on_stage: Callable[[str, str], None] | None) -> StageResult:
    """The report stage: the HTML page over the artifact the stages before it made, with this run's eval and bench
    reports and its eval stage's gates."""
    from ..report import write_report

    opts = cfg.to_options(output=f"{recipe.name}-report.html")
    if dry_run:
        return StageResult("report", "would run", None, summary={"path": opts.output})
    if on_stage:
        on_stage("report", "writing")
    t0 = time.perf_counter()
    ev = recipe.stages.eval
    path = write_report(store, [subject], opts, gate=ev.gate if ev is not None else None,
                        reports=[a for a in made if a.kind in ("eval-report", "bench-report")])
    return StageResult("report", "ran", None, time.perf_counter() - t0, summary={"path": str(path)})


def run_recipe(recipe: Recipe, store: Store, from_stage: str | None = None, dry_run: bool = False,
               on_stage: Callable[[str, str], None] | None = None) -> RunResult:
    """Run (or with dry_run, plan) every stage of `recipe`; `from_stage` forces that stage and all later ones."""
    present = [s for s in STAGE_ORDER if getattr(recipe.stages, s) is not None]
    if from_stage is not None:
        from_stage = from_stage.replace("-", "_")
        if from_stage not in present:
            raise LlmqError(f"--from {from_stage}: this recipe's stages are {', '.join(present)}")
    cache = StageCache(store)
    model = resolve_model(recipe.model, store)
    parent: Artifact | None = model
    results, gates = [], []
    forced = False
    made: list[Artifact] = []
    for stage in present:
        cfg = getattr(recipe.stages, stage)
        if stage == "report":   # last; not an artifact: the page is written again on every run
            results.append(_report(parent or model, cfg, store, recipe, made, dry_run, on_stage))
            break
        forced = forced or stage == from_stage
        key = _key(stage, parent, cfg, recipe) if parent is not None else None
        cached = cache.get(key) if key else None
        if dry_run:
            results.append(StageResult(stage, "would reuse" if cached and not forced else "would run", cached))
            if _feeds_next(stage, cfg):
                parent = cached if cached and not forced else None
            continue
        if on_stage:
            on_stage(stage, "reusing" if cached and not forced else "running")
        t0 = time.perf_counter()
        if cached is not None and not forced:
            art, status = cached, "reused"
        else:
            art, status = ADAPTERS[stage](parent, cfg, store, recipe), "ran"
            cache.put(key, art)
        results.append(StageResult(stage, status, art, time.perf_counter() - t0))
        made.append(art)
        if stage == "eval":
            gates = _gates(art, cfg.gate)
            if not all(passed for _, passed in gates):   # stop, but show the user why on the page
                if recipe.stages.report is not None:
                    results.append(_report(parent, recipe.stages.report, store, recipe, made, False, on_stage))
                break
        if _feeds_next(stage, cfg):
            parent = art
    return RunResult(recipe, model, results, gates)
