"""`llmq run RECIPE.yaml`: the whole pipeline from one file, with a final table of what it produced."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from ..errors import GateFailed
from ..pipeline.recipe import STAGE_ORDER, load_recipe
from ..pipeline.runner import RunResult, run_recipe
from .common import echo_json, get_store, human_bytes

STAGE_CHOICES = [s.replace("_", "-") for s in STAGE_ORDER]


def _size(art) -> str:
    return human_bytes(sum(f["size"] for f in art.manifest["files"].values()))


def _highlights(stage: str, art) -> str:
    """The few numbers a user reads per stage: quality next to what it bought."""
    m = art.metrics
    probe = m.get("probe") or {}
    if stage == "quantize":
        size = f"{m['ratio_vs_bf16']:.2f}x smaller than bf16 (linear layers {m['linear_ratio_vs_bf16']:.2f}x)" \
            if "ratio_vs_bf16" in m else ""
        quality = f"KLD {probe['kld_mean']:.4f}, top-1 {100 * probe['top1']:.1f}%" if probe else ""
        return ", ".join(p for p in (size, quality) if p)
    if stage == "quantize_kv":
        kv = f"KV {art.config.get('kv_cache_dtype')} ({m.get('granularity', '?')} scales)"
        return kv + (f", KLD {probe['kld_mean']:.4f}, top-1 {100 * probe['top1']:.1f}%" if probe else "")
    if stage == "build":
        return f"tp={art.config['options']['tp']} {art.config['options']['target']}, compile: " \
               f"{m.get('compile', {}).get('status', 'n/a')}"
    if stage == "eval":
        import json

        from ..evals.report import REPORT_JSON

        report = json.loads(art.file(REPORT_JSON).read_text())
        groups = report["scores"]["groups"]
        deltas = [f"{k} {d['delta']:+.1f} (CI {d['ci95'][0]:+.1f}..{d['ci95'][1]:+.1f})"
                  for k, d in report.get("deltas", {}).items() if k in groups]
        kld = [f"KLD {report['kld']['mean']:.4f}"] if report.get("kld") else []
        return ", ".join(deltas + kld)
    if stage == "bench":
        return ", ".join(f"{k.split('/')[0]}: {v:.0f} tok/s" for k, v in m.items() if k.endswith("/tokens_per_s"))
    return ""


def _table(result: RunResult) -> Table:
    t = Table(title=f"recipe {result.recipe.name}: {result.model.ref} ({result.model.id[:12]})")
    for col in ("stage", "status", "artifact", "size", "seconds", "results"):
        t.add_column(col)
    for r in result.stages:
        art = r.artifact
        t.add_row(r.stage.replace("_", "-"), r.status, f"{art.ref}\n{art.path}" if art else "-",
                  _size(art) if art else "-", f"{r.seconds:.1f}" if r.status == "ran" else "-",
                  _highlights(r.stage, art) if art else r.summary.get("path", ""))
    return t


@click.command("run")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--from", "from_stage", type=click.Choice(STAGE_CHOICES),
              help="Re-run this stage and every later one even if their inputs are unchanged.")
@click.option("--dry-run", is_flag=True, help="Validate the recipe and show which stages would run or be reused.")
@click.option("--json", "as_json", is_flag=True, help="Print the stages and their artifacts as JSON.")
@click.pass_context
def run(ctx, recipe, from_stage, dry_run, as_json):
    """Run every stage of RECIPE in order, skipping stages whose inputs are unchanged; exit 1 if a gate fails."""
    parsed = load_recipe(recipe)
    console = Console(stderr=True)
    result = run_recipe(parsed, get_store(ctx), from_stage=from_stage, dry_run=dry_run,
                        on_stage=lambda s, what: console.print(f"[bold]{s}[/bold]: {what}"))
    if as_json:
        echo_json({"recipe": parsed.name, "model": result.model.id, "failed_gates": result.failed_gates,
                   "gates": [{"gate": g, "passed": p} for g, p in result.gates],
                   "stages": [{"stage": r.stage, "status": r.status, "seconds": round(r.seconds, 2),
                               "artifact": r.artifact.ref if r.artifact else None,
                               "id": r.artifact.id if r.artifact else None,
                               "path": str(r.artifact.path) if r.artifact else r.summary.get("path")}
                              for r in result.stages]})
    else:
        out = Console()
        if not out.is_terminal:  # piped or logged: rich would wrap the table at 80 columns
            out = Console(width=200)
        out.print(_table(result))
        for gate, passed in result.gates:
            out.print(f"gate {gate}: " + ("[green]passed[/green]" if passed else "[red]FAILED[/red]"))
    if result.failed_gates:
        raise GateFailed("quality gate failed: " + "; ".join(result.failed_gates))
