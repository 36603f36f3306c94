"""`llmq report REF...`: the artifacts' HTML report."""

from __future__ import annotations

import click

from ..models import source_artifact
from ..report import ReportOptions
from .common import get_store
from .options import stage_options


@click.command("report")
@click.argument("refs", nargs=-1)
@stage_options(ReportOptions)
@click.pass_context
def report(ctx, refs, opts):
    """Write one self-contained HTML page over REFS side by side (default: the default model): lineage, size and
    bits per unit, KLD per layer and per position, expert coverage, eval deltas against the gates, bench curves."""
    from ..report import write_report

    store = get_store(ctx)
    arts = [store.resolve(r) for r in refs] if refs else [source_artifact(None, store)]
    click.echo(f"wrote {write_report(store, arts, opts)}")
