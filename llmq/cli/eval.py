"""`llmq eval`: task quality of an artifact as llmq serves it, against its baseline, with gates."""

from __future__ import annotations

import click

from ..errors import LlmqError
from ..evals.runner import EvalOptions
from ..models import source_artifact
from .common import echo_json, get_store
from .options import stage_command


def _progress_console():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False, disable=not console.is_terminal)
    return console, prog


def progress_factory(prog):
    """One rich bar per phase: phase name -> (todo, done) callback."""
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

    return progress


@stage_command("eval", EvalOptions, "Print the report as JSON.")
def eval_(ctx, ref, opts, as_json):
    """Evaluate REF (default: the default model), or the model an OpenAI-compatible server serves (--endpoint), on
    offline task groups, against a baseline, and gate on it."""
    from ..evals.evaluate import Served, pick_baseline, run_eval
    from ..evals.gate import enforce, parse_gates
    from ..evals.report import markdown

    opts.check()
    gates = parse_gates(opts.gate)
    store = get_store(ctx)
    settings = opts.settings(store)
    if opts.endpoint:
        if ref:
            raise LlmqError("give REF or --endpoint URL, not both")
        evaluated = Served.connect(opts.endpoint, opts.model, opts.api_key, opts.timeout, store)
        art = evaluated.artifact
    else:
        evaluated = art = source_artifact(ref, store)
    console, prog = _progress_console()
    base = pick_baseline(store, art, opts.baseline)
    if base is not None and not opts.baseline:
        console.print(f"baseline: {base.ref} (the root model of {art.ref}'s lineage; --baseline to change)")
    if gates and base is None:
        raise LlmqError("--gate compares against a baseline: pass --baseline REF")

    with prog:
        outcome = run_eval(store, evaluated, base, settings, gates, progress_factory(prog), name=opts.name)
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
