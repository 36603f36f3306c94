"""Does a deployment compute what llmq evaluated? (`llmq deploy verify`)

The same tasks and KL divergence, against the same baseline, run twice: through the endpoint (the engine as
deployed) and in-process on the artifact it serves (for an export llmq's runtime does not load, a GGUF or a
TensorRT-LLM checkpoint, the artifact it was built from: the same values in llmq's arithmetic). Each task score,
the mean KL divergence and top-1 agreement must agree within the 95% interval of their difference (compare.delta:
independent runs, so conservative for the paired items). Where the endpoint gives only its top k logprobs, llmq's
own KL is taken from its top k the same way, so both sides are the same estimator.
"""

from __future__ import annotations

from dataclasses import replace

from ..artifacts import Artifact, Store
from ..errors import LlmqError
from .compare import delta
from .evaluate import ProgressFactory, Served, default_baseline, run_eval
from .gate import Gate
from .runner import EvalSettings

KLD_FIGURES = {"kld": ("mean", "stderr"), "top1": ("top1", "top1_stderr")}


def served_source(store: Store, art: Artifact) -> Artifact:
    """The artifact a deployment serves: a deploy artifact's source, or `art` itself."""
    if art.kind != "deploy":
        return art
    if not art.manifest.get("parents"):
        raise LlmqError(f"{art.ref} records no source artifact")
    return store.resolve(art.manifest["parents"][0])


def in_process(store: Store, served: Artifact) -> Artifact:
    """What llmq runs for `served`: itself, or for an engine of another target (a GGUF, a TensorRT-LLM checkpoint)
    the artifact it was built from, whose values the export carries."""
    if served.kind != "engine":
        return served
    from ..models.engine_spec import EngineSpec

    spec = EngineSpec.read(served.path)
    return served if spec.native else store.resolve(spec.source["id"])


def verify_deployment(store: Store, source: Artifact, served: Served, settings: EvalSettings, gates: list[Gate],
                      progress: ProgressFactory | None = None, command: str | None = None) -> dict:
    """Evaluate `served` (its scores judged by `gates`) and `source` on the same settings and compare them:
    {"figures": [...], "agree": bool, "gates": [...], "reports": {endpoint, in_process: eval-report refs},
    "refused": [...]}."""
    base = default_baseline(store, source)
    if settings.kld and base is None:
        raise LlmqError(f"kld compares {source.ref} with the model it was quantized from, and it has none: "
                        "drop kld from --tasks")
    served = replace(served, artifact=source)
    remote = run_eval(store, served, base, settings, gates, progress, command, name=f"{source.name}-deployed-eval")
    # the in-process run: what the endpoint ran (its refusals dropped), its KL taken the endpoint's way
    kld = remote.report["kld"]
    tasks = list(settings.lm_tasks) + (["kld"] if settings.kld else [])
    local_settings = EvalSettings(tasks=tasks, limit=settings.limit, seed=settings.seed,
                                  allow_code_execution=settings.allow_code_execution,
                                  kld_top_k=kld["top_k"] if kld else None)
    ours = in_process(store, source)
    local = run_eval(store, ours, base, local_settings, [], progress, command)
    figures = compare_reports(remote.report, local.report)
    return {"source": {"ref": source.ref, "id": source.id}, "in_process": {"ref": ours.ref, "id": ours.id},
            "endpoint": served.endpoint.base,
            "baseline": base.ref if base is not None else None, "figures": figures,
            "agree": all(f["agrees"] for f in figures), "gates": remote.report["gates"],
            "refused": remote.report["refused"],
            "reports": {"endpoint": remote.artifact.ref, "in_process": local.artifact.ref}}


def compare_reports(remote: dict, local: dict) -> list[dict]:
    """Every task score and KL figure both reports hold: endpoint minus in-process, its 95% interval, agreement."""
    pairs = [(name, s, local["scores"]["tasks"][name]) for name, s in remote["scores"]["tasks"].items()
             if name in local["scores"]["tasks"]]
    if remote.get("kld") and local.get("kld"):
        pairs += [(name, {"value": remote["kld"][v], "stderr": remote["kld"][e]},
                   {"value": local["kld"][v], "stderr": local["kld"][e]}) for name, (v, e) in KLD_FIGURES.items()]
    out = []
    for name, r, ours in pairs:
        d = delta(r, ours)
        lo, hi = d["ci95"]
        out.append({"figure": name, "endpoint": r["value"], "in_process": ours["value"], "difference": d["delta"],
                    "ci95": d["ci95"], "agrees": lo <= 0 <= hi or d["delta"] == 0})
    return out


def table(result: dict) -> list[str]:
    """The comparison as a markdown table."""
    rows = ["| figure | endpoint | llmq in-process | difference (95% CI) | agrees |", "|---|---|---|---|---|"]
    for f in result["figures"]:
        lo, hi = f["ci95"]
        rows.append(f"| {f['figure']} | {f['endpoint']:.4g} | {f['in_process']:.4g} | {f['difference']:+.4g} "
                    f"({lo:+.3g} .. {hi:+.3g}) | {'yes' if f['agrees'] else 'NO'} |")
    return rows
