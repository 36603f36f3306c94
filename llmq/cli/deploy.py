"""`llmq deploy`: the sized launch commands of a serving engine for an artifact, written as a deploy artifact."""

from __future__ import annotations

import json

import click

from ..models import source_artifact
from ..pipeline.deploy import DeployOptions, deploy
from .common import echo_json, get_store
from .options import stage_command


@stage_command("deploy", DeployOptions, "Print the deploy artifact's manifest as JSON.")
def deploy_(ctx, ref, opts, as_json):
    """Size and write the launch of REF (default: the default model) on a serving engine: the GPUs and nodes it
    needs, the commands for each node, a README."""
    store = get_store(ctx)
    art = deploy(source_artifact(ref, store), store, opts)
    if as_json:
        echo_json(art.manifest)
        return
    record = json.loads(art.file("deploy.json").read_text())
    s = record["sizing"]
    click.echo(f"wrote {art.ref} ({record['engine']} on {s['gpus_per_node']} x {s['nodes']} {s['gpu']}, "
               f"tp {s['tp']} x pp {s['pp']}) at {art.path}")
    for line in record["table"]:
        click.echo(line)
    for step in record["steps"]:
        click.echo(f"on {step['where']}: {step['run']}")
