"""What every subcommand shares: the store option, JSON output, the one-line error convention."""

from __future__ import annotations

import json

import click

from ..artifacts import Store


def get_store(ctx: click.Context) -> Store:
    return Store.open(ctx.find_root().obj.get("store"))


def echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
