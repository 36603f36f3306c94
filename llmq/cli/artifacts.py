"""`llmq import`, `llmq ls`, `llmq inspect`, `llmq lineage`: the store as a user sees it."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from ..artifacts import KINDS
from ..models import resolve_model
from .common import echo_json, get_store, human_bytes


def _size(art) -> int:
    return sum(f["size"] for f in art.manifest["files"].values())


@click.command("import")
@click.argument("model", required=False)
@click.option("--allow-pickle", is_flag=True, help="Accept .bin/.pt checkpoints (pickle can run code).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.pass_context
def import_(ctx, model, allow_pickle, as_json):
    """Import MODEL (HF directory, .gguf file, hub id; default: SmolLM2-135M-Instruct) into the store."""
    art = resolve_model(model, get_store(ctx), allow_pickle=allow_pickle)
    if as_json:
        echo_json(art.manifest)
    else:
        click.echo(f"{art.ref}  {art.id[:12]}  {art.path}")


@click.command("ls")
@click.option("--kind", type=click.Choice(KINDS), help="Only artifacts of this kind.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx, kind, as_json):
    """List the artifacts in the store; those with a damaged manifest are listed as damaged, after the others."""
    store = get_store(ctx)
    damaged = []
    arts = store.list(kind=kind, damaged=damaged)
    if as_json:
        echo_json([{"ref": a.ref, "kind": a.kind, "id": a.id, "parents": a.parents,
                    "created": a.manifest.get("created"),
                    "size": _size(a), "path": str(a.path)} for a in arts]
                  + [{"ref": ref, "damaged": str(e)} for ref, e in damaged])
        return
    table = Table(title=f"llmq store {store.root}")
    for col in ("artifact", "kind", "id", "parent", "size", "created"):
        table.add_column(col)
    for a in arts:
        table.add_row(a.ref, a.kind, a.id[:12], a.parents[0][:12] if a.parents else "-", human_bytes(_size(a)),
                      a.manifest.get("created", ""))
    for ref, _ in damaged:
        table.add_row(ref, "DAMAGED", "-", "-", "-", "-")
    Console().print(table)
    for ref, e in damaged:
        click.echo(f"damaged: {ref}: {e}", err=True)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            rows += _flatten(v, key + ".")
        else:
            rows.append((key, str(v)))
    return rows


@click.command("inspect")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.pass_context
def inspect(ctx, ref, as_json):
    """Show an artifact's manifest: provenance, config, architecture, metrics, files (hashes verified)."""
    art = get_store(ctx).resolve(ref)
    if as_json:
        echo_json({**art.manifest, "path": str(art.path)})
        return
    console = Console()
    head = Table(show_header=False, title=f"{art.kind} {art.ref}")
    for k in ("id", "parents", "created", "command"):
        head.add_row(k, str(art.manifest.get(k)))
    head.add_row("path", str(art.path))
    head.add_row("size", human_bytes(_size(art)))
    console.print(head)
    for section in ("config", "metrics", "environment"):
        data = art.manifest.get(section) or {}
        if data:
            t = Table(title=section, show_header=False)
            for k, v in _flatten(data):
                t.add_row(k, v)
            console.print(t)
    files = Table(title="files")
    for col in ("file", "size", "sha256"):
        files.add_column(col)
    for rel, meta in art.manifest["files"].items():
        files.add_row(rel, human_bytes(meta["size"]), meta["sha256"][:16])
    console.print(files)


@click.command("lineage")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lineage(ctx, ref, as_json):
    """The chain of artifacts from REF back to its source model."""
    store = get_store(ctx)
    chain = store.lineage(store.resolve(ref))
    if as_json:
        echo_json([{"ref": a.ref, "kind": a.kind, "id": a.id, "command": a.manifest.get("command"),
                    "source": a.config.get("source")} for a in chain])
        return
    for depth, a in enumerate(chain):
        src = a.config.get("source")
        extra = (f"  source: {src.get('type')} {src.get('package', src.get('path', src.get('repo_id', '')))}"
                 if src else "")
        click.echo(f"{'  ' * depth}{'└─ ' if depth else ''}{a.ref} [{a.kind}] {a.id[:12]}  "
                   f"{a.manifest.get('command', '')}{extra}")
    if chain[-1].parents:
        click.echo(f"{'  ' * len(chain)}└─ parent {chain[-1].parents[0][:12]} is not in this store")
