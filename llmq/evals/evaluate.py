"""The eval stage: evaluated artifact (+ baseline) + settings -> an eval-report artifact, gates checked.

The baseline's scores are cached in the baseline's own eval-report (found by scores key: artifact id, tasks, limit,
seed, lm-eval version, backend, task-data fingerprint), so a baseline is evaluated once however many candidates
are compared with it. KL divergence needs both models' full distributions, so it is always computed afresh.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..artifacts import Artifact, Store
from ..errors import LlmqError
from .compare import compare
from .gate import Gate, GateResult, check_gates
from .kld import kl_divergence
from .report import find_cached_scores, write_report
from .runner import EvalSettings, plan, run_lm_tasks, settings_dict

ProgressFactory = Callable[[str], Callable[[int, int], None]]  # phase description -> (todo, done) callback


@dataclass
class EvalOutcome:
    report: dict
    artifact: Artifact
    gates: list[GateResult]
    baseline_cached: Artifact | None  # the eval-report the baseline's scores came from, if cached
    wall_s: float


def default_baseline(store: Store, art: Artifact) -> Artifact | None:
    """For a quantized or engine artifact: the model artifact at the root of its lineage."""
    if art.kind == "model":
        return None
    models = [a for a in store.lineage(art)[1:] if a.kind == "model"]
    return store.resolve(models[-1].path) if models else None


def pick_baseline(store: Store, art: Artifact, ref: str | None) -> Artifact | None:
    """What `--baseline REF` names: nothing for 'none', the artifact REF, by default `default_baseline`."""
    if ref and ref.lower() == "none":
        return None
    if ref:
        from ..models import source_artifact

        base = source_artifact(ref, store)
    else:
        base = default_baseline(store, art)
    if base is not None and base.id == art.id:
        raise LlmqError("the baseline is the evaluated artifact itself")
    return base


def _lm(settings: EvalSettings, art: Artifact, progress, speculative: dict | None = None):
    if art.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"{art.ref} is a {art.kind} artifact; eval takes a model, quantized or engine artifact")
    if settings.backend == "hf" and art.kind == "engine":
        raise LlmqError("--backend hf loads checkpoints; evaluate the engine's source artifact instead")
    from .lm import make_lm

    return make_lm(settings.backend, art.path, seed=settings.seed, progress=progress, speculative=speculative)


def _check_both_fit(evaluated: Artifact, baseline: Artifact) -> None:
    """kld scores every window with both models, so both stay loaded: refuse in one line, before loading the
    baseline, when their weights alone would not fit (an 8B bf16 baseline is 32 GB in the CPU runtime's float32),
    rather than be killed for memory halfway."""
    import torch

    from ..models import pick_device
    from ..models.reader import CheckpointReader
    from ..runtime.layers.linear import keeps_16bit_as
    from ..runtime.model_runner import compute_dtype_for
    from ..runtime.worker import available_memory

    device = torch.device(pick_device())

    def loaded(art: Artifact) -> int:
        dirs = sorted(p for p in art.path.glob("rank*") if p.is_dir()) or [art.path]
        readers = [CheckpointReader(d) for d in dirs]
        dtypes = [compute_dtype_for(device, None, r.config) for r in readers]
        return sum(r.runtime_bytes(dt, functools.partial(keeps_16bit_as, dtype=dt, device=device))
                   for r, dt in zip(readers, dtypes))

    need, have = loaded(evaluated) + loaded(baseline), available_memory(device)
    if need > have:
        raise LlmqError(f"kld keeps {evaluated.ref} and the baseline {baseline.ref} loaded together: about "
                        f"{need / 2**30:.1f} GiB of weights, {have / 2**30:.1f} GiB available; the quantize probe "
                        "(`llmq inspect`, metrics.probe) measures KLD layer by layer, or run kld on a bigger machine")


def run_eval(store: Store, evaluated: Artifact, baseline: Artifact | None, settings: EvalSettings,
             gates: list[Gate], progress: ProgressFactory | None = None, command: str | None = None,
             name: str | None = None) -> EvalOutcome:
    try:
        import lm_eval  # noqa: F401  (what every path below runs through; the CLI and `llmq run` both land here)
    except ImportError:
        raise LlmqError("llmq eval needs lm-eval: pip install 'llmq[eval]'") from None
    progress = progress or (lambda phase: (lambda todo, done: None))
    t0 = time.monotonic()
    ts = plan(settings)
    if settings.kld and baseline is None:
        raise LlmqError("kld compares against a baseline: pass --baseline REF (or evaluate a quantized artifact)")
    lm = _lm(settings, evaluated, progress(f"{evaluated.ref}"), settings.speculative)
    try:
        scores = run_lm_tasks(lm, ts, settings)
        base_scores, cached, hit, kld, base_lm = None, None, None, None, None
        try:
            if baseline is not None:
                key = settings.scores_key(baseline.id, ts.info)
                hit = find_cached_scores(store, baseline, key) if settings.lm_tasks else None
                if hit is not None:
                    cached, base_scores = hit
                if (hit is None and settings.lm_tasks) or settings.kld:
                    if settings.kld:
                        _check_both_fit(evaluated, baseline)
                    base_lm = _lm(settings, baseline, progress(f"baseline {baseline.ref}"))
                if hit is None and settings.lm_tasks:
                    tb = time.monotonic()
                    base_scores = run_lm_tasks(base_lm, ts, settings)
                    base_report = _report(baseline, None, base_scores, None, None, settings, ts.info, key)
                    cached = write_report(store, base_report, baseline, None, command,
                                          run_metrics=_timing(base_scores, time.monotonic() - tb))
                if settings.kld:
                    from .runner import kld_texts

                    kld = kl_divergence(lm, base_lm, kld_texts(ts, settings.limit), progress("kl divergence"))
        finally:
            if base_lm is not None:
                base_lm.close()
    finally:
        lm.close()
    report = _report(evaluated, baseline, scores, base_scores, kld, settings, ts.info,
                     settings.scores_key(evaluated.id, ts.info))
    run_metrics = _timing(scores, time.monotonic() - t0)
    if cached is not None:
        run_metrics.update(baseline_scores_from=cached.ref, baseline_scores_cached=hit is not None)
    results = check_gates(gates, report)
    report["gates"] = [{"gate": str(r.gate), "value": r.value, "what": r.what, "passed": r.passed} for r in results]
    art = write_report(store, report, evaluated, baseline, command, name, run_metrics)
    return EvalOutcome(report, art, results, hit[0] if hit is not None else None, run_metrics["wall_s"])


def _timing(scores: dict, wall_s: float) -> dict:
    return {"wall_s": round(wall_s, 1), "seconds_by_request_type": scores.get("seconds", {})}


def _report(evaluated: Artifact, baseline: Artifact | None, scores: dict, base_scores: dict | None,
            kld: dict | None, settings: EvalSettings, info: dict, key: str) -> dict:
    from lm_eval import __version__ as lm_eval_version

    ref = lambda a: {"name": a.name, "id": a.id, "kind": a.kind}  # noqa: E731  (no version: it varies by store)
    return {"evaluated": ref(evaluated), "baseline": ref(baseline) if baseline is not None else None,
            "scores": {"tasks": scores.get("tasks", {}), "groups": scores.get("groups", {})},
            "baseline_scores": {k: base_scores.get(k, {}) for k in ("tasks", "groups")} if base_scores else None,
            "deltas": compare(scores, base_scores) if base_scores else {},
            "kld": kld, "settings": settings_dict(settings), "seeds": {k: settings.seed for k in (
                "task_data", "python", "numpy", "torch", "fewshot", "sampling")},
            "task_data": info, "lm_eval": lm_eval_version, "scores_key": key}
