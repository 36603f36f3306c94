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
    if stage == "quantize" and "kld_mean" in m:
        return f"KLD {m['kld_mean']:.4f}, top-1 {100 * m['top1_agreement']:.1f}%"
    if stage == "quantize_kv" and "kld_mean" in m:
        return f"KV {art.config.get('kv')}, KLD {m['kld_mean']:.4f}"
    if stage == "build":
        return f"tp={art.config['options']['tp']} {art.config['options']['target']}, compile: " \
               f"{m.get('compile', {}).get('status', 'n/a')}"
    if stage == "eval":
        parts = [f"{k} {v['delta']:+.2f}±{v['ci95']:.2f}" for k, v in m.get("deltas", {}).items()]
        return ", ".join(parts) or ", ".join(f"{k} {v:.3g}" for k, v in m.get("scores", {}).items())
    if stage == "bench":
        return ", ".join(f"bs{r['batch_size']}: {r['output_tokens_per_s']:.0f} tok/s" for r in m.get("rows", []))
    return ""


def _table(result: RunResult) -> Table:
    t = Table(title=f"recipe {result.recipe.name}: {result.model.ref} ({result.model.id[:12]})")
    for col in ("stage", "status", "artifact", "size", "seconds", "results"):
        t.add_column(col)
    for r in result.stages:
        art = r.artifact
        t.add_row(r.stage.replace("_", "-"), r.status, f"{art.ref}\n{art.path}" if art else "-",
                  _size(art) if art else "-", f"{r.seconds:.1f}" if r.status == "ran" else "-",
                  _highlights(r.stage, art) if art else "")
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
                   "stages": [{"stage": r.stage, "status": r.status, "seconds": round(r.seconds, 2),
                               "artifact": r.artifact.ref if r.artifact else None,
                               "id": r.artifact.id if r.artifact else None,
                               "path": str(r.artifact.path) if r.artifact else None} for r in result.stages]})
    else:
        Console().print(_table(result))
    if result.failed_gates:
        raise GateFailed("quality gate failed: " + "; ".join(result.failed_gates))
