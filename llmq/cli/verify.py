"""`llmq verify`: re-hash every file of an artifact (a load only checks sizes and stamps)."""

from __future__ import annotations

import click

from .common import get_store, human_bytes


@click.command("verify")
@click.argument("ref")
@click.pass_context
def verify(ctx, ref):
    """Re-hash every file of REF against its manifest; exit 2 naming the first file that does not match."""
    art = get_store(ctx).resolve(ref, verify=False)
    n = art.verify(full=True)
    size = sum(f["size"] for f in art.manifest["files"].values())
    click.echo(f"OK {art.ref} {art.id[:12]}: {n} files, {human_bytes(size)} re-hashed")
