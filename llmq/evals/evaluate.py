"""The eval stage: evaluated artifact (+ baseline) + settings -> an eval-report artifact, gates checked.

The baseline's scores are cached in the baseline's own eval-report (found by scores key: artifact id, tasks, limit,
seed, lm-eval version, backend, task-data fingerprint), so a baseline is evaluated once however many candidates
are compared with it. KL divergence needs both models' distributions, so it is always computed afresh.

The evaluated model is an artifact (run in-process) or `Served`: an OpenAI-compatible endpoint (endpoint.py), whose
baseline still runs in-process. What the endpoint cannot give (scoring tasks without prompt logprobs, kld without
logprobs) fails the run before anything runs, or with `skip_unsupported` is refused in the report's `refused` lines
while the rest runs.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..artifacts import Artifact, Store
from ..bench.loadgen import Endpoint
from ..errors import LlmqError
from .compare import compare
from .gate import Gate, GateResult, check_gates
from .kld import kl_divergence
from .report import find_cached_scores, write_report
from .runner import EvalSettings, plan, run_lm_tasks, scoring_tasks, settings_dict

ProgressFactory = Callable[[str], Callable[[int, int], None]]  # phase description -> (todo, done) callback
IMAGE_KLD_N = 25   # image conversations the KLD on image-conditioned text reads at most
IMAGE_KLD_SEED = 1   # their seed's offset from the evaluation's (with both defaults: images calibration never drew)


@dataclass
class Served:
    """The model an OpenAI-compatible endpoint serves, as the evaluated model."""

    endpoint: Endpoint
    artifact: Artifact | None  # the store's artifact it serves, when it serves one (lineage, tokenizer, baseline)
    timeout: float = 60.0  # seconds per answer

    @classmethod
    def connect(cls, url: str, model: str | None, api_key: str | None, timeout: float, store: Store) -> Served:
        """Check that `url` serves the OpenAI API and `model` (a one-line LlmqError, bounded by `timeout`)."""
        import asyncio

        from ..bench.loadgen import probe
        from ..bench.online import served_artifact

        ep = asyncio.run(probe(url, model, api_key, timeout))
        return cls(ep, served_artifact(ep, store), timeout)

    @property
    def name(self) -> str:
        return self.artifact.name if self.artifact is not None else re.sub(r"[^A-Za-z0-9._-]+", "-",
                                                                            self.endpoint.model).strip("-.") or "model"

    def ref(self, logprobs: str | None) -> dict:
        """The report's `evaluated`; logprobs: the shape the server gave them in (endpoint.PROMPT_SHAPES, ...)."""
        ep = self.endpoint
        return {"name": ep.model, "id": self.artifact.id if self.artifact is not None else None, "kind": "endpoint",
                "url": ep.base, "logprobs": logprobs}


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


def pick_baseline(store: Store, art: Artifact | None, ref: str | None) -> Artifact | None:
    """What `--baseline REF` names: nothing for 'none', the artifact REF, by default `default_baseline` (none for an
    endpoint that serves no artifact of the store)."""
    if ref and ref.lower() == "none":
        return None
    if ref:
        from ..models import source_artifact

        base = source_artifact(ref, store)
    else:
        base = default_baseline(store, art) if art is not None else None
    if base is not None and art is not None and base.id == art.id:
        raise LlmqError("the baseline is the evaluated artifact itself")
    return base


def _lm(settings: EvalSettings, art: Artifact, progress, speculative: dict | None = None):
    if art.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"{art.ref} is a {art.kind} artifact; eval takes a model, quantized or engine artifact")
    if settings.backend == "hf" and art.kind == "engine":
        raise LlmqError("--backend hf loads checkpoints; evaluate the engine's source artifact instead")
    from .lm import make_lm

    return make_lm(settings.backend, art.path, seed=settings.seed, progress=progress, speculative=speculative)


def _endpoint_lm(store: Store, settings: EvalSettings, served: Served, progress, tokenizer_from: Artifact | None):
    """The endpoint as an LM, with the tokenizer of the model it serves (else the baseline's): the in-process
    backends' token ids are what it is sent."""
    from ..bench.online import find_tokenizer
    from .endpoint import EndpointLM

    tok = find_tokenizer(served.endpoint, None, store)
    if tok is None and tokenizer_from is not None:
        tok = find_tokenizer(served.endpoint, str(tokenizer_from.path), store)
    if tok is None:
        raise LlmqError(f"no tokenizer for {served.endpoint.model!r}: the endpoint serves no artifact of this store "
                        "(give --baseline REF, whose tokenizer it must share)")
    return EndpointLM(served.endpoint, tok, seed=settings.seed, progress=progress, timeout=served.timeout)


def _check_both_fit(evaluated: Artifact, baseline: Artifact) -> None:
    """kld scores every window with both models, so both stay loaded: refuse in one line, before loading the
    baseline, when their weights alone would not fit (an 8B bf16 baseline is 32 GB in the CPU runtime's float32),
    rather than be killed for memory halfway."""
    import torch

    from ..models import pick_device
    from ..models.reader import CheckpointReader
    from ..runtime.layers.linear import keeps_as_stored
    from ..runtime.model_runner import compute_dtype_for
    from ..runtime.worker import available_memory

    device = torch.device(pick_device())

    def loaded(art: Artifact) -> int:
        dirs = sorted(p for p in art.path.glob("rank*") if p.is_dir()) or [art.path]
        readers = [CheckpointReader(d) for d in dirs]
        dtypes = [compute_dtype_for(device, None, r.config) for r in readers]
        return sum(r.runtime_bytes(dt, functools.partial(keeps_as_stored, dtype=dt, device=device))
                   for r, dt in zip(readers, dtypes))

    need, have = loaded(evaluated) + loaded(baseline), available_memory(device)
    if need > have:
        raise LlmqError(f"kld keeps {evaluated.ref} and the baseline {baseline.ref} loaded together: about "
                        f"{need / 2**30:.1f} GiB of weights, {have / 2**30:.1f} GiB available; the quantize probe "
                        "(`llmq inspect`, metrics.probe) measures KLD layer by layer, or run kld on a bigger machine")


def run_eval(store: Store, evaluated: Artifact | Served, baseline: Artifact | None, settings: EvalSettings,
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
    served = isinstance(evaluated, Served)
    if served:
        lm = _endpoint_lm(store, settings, evaluated, progress(evaluated.endpoint.base), baseline)
    else:
        lm = _lm(settings, evaluated, progress(f"{evaluated.ref}"), settings.speculative)
        lm.top_k = settings.kld_top_k
    refused: list[str] = []
    try:
        if served:
            refused = _refuse(lm, ts, settings)
            if refused and not settings.skip_unsupported:
                raise LlmqError("; ".join(refused) + " (--skip-unsupported runs the rest)")
            if not settings.lm_tasks and not settings.kld:
                raise LlmqError("the endpoint can give none of the tasks: " + "; ".join(refused))
        base_settings = replace(settings, backend="llmq", speculative={}) if served else settings  # in-process
        scores = run_lm_tasks(lm, ts, settings)
        base_scores, cached, hit, kld, base_lm = None, None, None, None, None
        try:
            if baseline is not None:
                key = base_settings.scores_key(baseline.id, ts.info)
                hit = find_cached_scores(store, baseline, key) if settings.lm_tasks else None
                if hit is not None:
                    cached, base_scores = hit
                if (hit is None and settings.lm_tasks) or settings.kld:
                    if settings.kld and not served:
                        _check_both_fit(evaluated, baseline)
                    base_lm = _lm(base_settings, baseline, progress(f"baseline {baseline.ref}"))
                if hit is None and settings.lm_tasks:
                    tb = time.monotonic()
                    base_scores = run_lm_tasks(base_lm, ts, base_settings)
                    base_report = _report(_ref(baseline), None, base_scores, None, None, base_settings, ts.info, key)
                    cached = write_report(store, base_report, [baseline.id], f"{baseline.name}-eval", command,
                                          run_metrics=_timing(base_scores, time.monotonic() - tb))
                if settings.kld:
                    from .runner import kld_texts

                    kld = kl_divergence(lm, base_lm, kld_texts(ts, settings.limit), progress("kl divergence"))
                    images = None if served else _image_kld(lm, base_lm, evaluated, settings)
                    if images is not None:
                        kld["images"] = images
        finally:
            if base_lm is not None:
                base_lm.close()
    finally:
        lm.close()
    ref, art = (evaluated.ref(lm.shape), evaluated.artifact) if served else (_ref(evaluated), evaluated)
    report = _report(ref, baseline, scores, base_scores, kld, settings, ts.info,
                     settings.scores_key(art.id if art is not None else ref["url"] + "#" + ref["name"], ts.info))
    report["refused"] = refused
    run_metrics = _timing(scores, time.monotonic() - t0)
    if cached is not None:
        run_metrics.update(baseline_scores_from=cached.ref, baseline_scores_cached=hit is not None)
    results = check_gates(gates, report)
    report["gates"] = [{"gate": str(r.gate), "value": r.value, "what": r.what, "passed": r.passed} for r in results]
    parents = ([art.id] if art is not None else []) + ([baseline.id] if baseline is not None else [])
    default_name = f"{evaluated.name}-endpoint-eval" if served else f"{evaluated.name}-eval"
    out = write_report(store, report, parents, name or default_name, command, run_metrics)
    return EvalOutcome(report, out, results, hit[0] if hit is not None else None, run_metrics["wall_s"])


def _image_kld(lm, base_lm, evaluated: Artifact, settings: EvalSettings) -> dict | None:
    """The KLD on image-conditioned text of a vision-language model the runtime runs with images (None for any
    other): generated image + question conversations with their answers, as quantize's image calibration renders
    them, drawn from the evaluation's seed + IMAGE_KLD_SEED."""
    from ..models.vision import runs_images
    from ..pipeline.quantize.calib_images import image_samples
    from .kld import image_kl

    engine = getattr(lm, "engine", None)
    if engine is None or not runs_images(engine.spec.vision):
        return None
    samples, _ = image_samples(evaluated.path, lm.tokenizer, min(settings.limit or IMAGE_KLD_N, IMAGE_KLD_N),
                               settings.seed + IMAGE_KLD_SEED)
    return image_kl(lm, base_lm, samples, engine.runner.vision.image_token)


def _refuse(lm, ts, settings: EvalSettings) -> list[str]:
    """Drop from `settings` what the endpoint cannot give; one line each for the report."""
    out = []
    if not lm.scores_prompts:
        drop = scoring_tasks(ts, settings.lm_tasks)
        if drop:
            settings.lm_tasks = [t for t in settings.lm_tasks if t not in drop]
            out.append(lm.refusal(", ".join(drop) + " (they score given text)"))
    if settings.kld and lm.shape is None:
        settings.kld = False
        out.append(lm.refusal("kld"))
    return out


def _ref(a: Artifact) -> dict:
    return {"name": a.name, "id": a.id, "kind": a.kind}  # no version: it varies by store


def _timing(scores: dict, wall_s: float) -> dict:
    return {"wall_s": round(wall_s, 1), "seconds_by_request_type": scores.get("seconds", {})}


def _report(evaluated: dict, baseline: Artifact | None, scores: dict, base_scores: dict | None,
            kld: dict | None, settings: EvalSettings, info: dict, key: str) -> dict:
    from lm_eval import __version__ as lm_eval_version

    return {"evaluated": evaluated, "baseline": _ref(baseline) if baseline is not None else None,
            "scores": {"tasks": scores.get("tasks", {}), "groups": scores.get("groups", {})},
            "baseline_scores": {k: base_scores.get(k, {}) for k in ("tasks", "groups")} if base_scores else None,
            "deltas": compare(scores, base_scores) if base_scores else {},
            "kld": kld, "settings": settings_dict(settings), "seeds": {k: settings.seed for k in (
                "task_data", "python", "numpy", "torch", "fewshot", "sampling")},
            "task_data": info, "lm_eval": lm_eval_version, "scores_key": key}
