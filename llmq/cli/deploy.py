"""`llmq deploy`: the sized launch commands of a serving engine for an artifact, written as a deploy artifact;
`llmq deploy verify`: whether the running deployment computes what llmq evaluated."""

from __future__ import annotations

import json

import click

from ..evals.runner import VerifyOptions
from ..models import source_artifact
from ..pipeline.deploy import DeployOptions, deploy
from .common import echo_json, get_store
from .options import stage_command, stage_options


class DeployGroup(click.Group):
    """`llmq deploy [REF] [options]` writes (the `write` command); `llmq deploy verify ...` checks."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands:
            args = ["write", *args]
        return super().parse_args(ctx, args)


@click.group("deploy", cls=DeployGroup)
def deploy_():
    """Write the sized launch of an artifact on a serving engine, or verify a running deployment."""


@stage_command("write", DeployOptions, "Print the deploy artifact's manifest as JSON.", group=deploy_, hidden=True)
def write(ctx, ref, opts, as_json):
    """Size and write the launch of REF (default: the default model) on a serving engine: the GPUs and nodes it
    needs, the commands for each node, a README. `llmq deploy verify DEPLOY --endpoint URL` then checks the
    running deployment."""
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


@deploy_.command("verify")
@click.argument("ref")
@stage_options(VerifyOptions)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.pass_context
def verify(ctx, ref, opts, as_json):
    """Evaluate the deployment at --endpoint and REF (a deploy artifact, or the artifact it serves) in-process on
    the same tasks against the same baseline; exit 1 when a figure differs beyond its 95% interval."""
    from ..errors import GateFailed
    from ..evals.deployed import served_source, table, verify_deployment
    from ..evals.evaluate import Served
    from ..evals.gate import parse_gates
    from .eval import _progress_console, progress_factory

    opts.check()
    gates = parse_gates(opts.gate)
    store = get_store(ctx)
    source = served_source(store, store.resolve(ref))
    served = Served.connect(opts.endpoint, opts.model, opts.api_key, opts.timeout, store)
    console, prog = _progress_console()
    with prog:
        result = verify_deployment(store, source, served, opts.settings(), gates, progress_factory(prog))
    if as_json:
        echo_json(result)
    else:
        gates_out = [f"gate {g['gate']}: {g['what']} {'passed' if g['passed'] else 'FAILED'}" for g in result["gates"]]
        for line in [*table(result), *(f"refused: {r}" for r in result["refused"]), *gates_out]:
            click.echo(line)
        click.echo(f"in-process: {result['in_process']['ref']}; eval reports: {result['reports']['endpoint']} "
                   f"(endpoint), {result['reports']['in_process']} (in-process)")
    failed = [f"{served.endpoint.base} does not compute what llmq evaluated for {source.ref}: "
              + ", ".join(f["figure"] for f in result["figures"] if not f["agrees"])] if not result["agree"] else []
    failed += [f"gate failed: {g['gate']} ({g['what']})" for g in result["gates"] if not g["passed"]]
    if failed:
        raise GateFailed("; ".join(failed))
