"""What every subcommand shares: the store option, JSON output, the one-line error convention."""

from __future__ import annotations

import json

import click

from ..artifacts import Store
from ..options import human_bytes  # noqa: F401 (the subcommands import it from here)


def get_store(ctx: click.Context) -> Store:
    return Store.open(ctx.find_root().obj.get("store"))


def echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
