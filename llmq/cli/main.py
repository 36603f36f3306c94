"""The `llmq` command: a thin shell over the stages. Parse, call, print; no logic here."""

from __future__ import annotations

import click

from .. import __version__
from ..artifacts import ArtifactError
from ..errors import LlmqError
from .artifacts import import_, inspect, lineage, ls
from .bench import bench
from .build import build
from .deploy import deploy_
from .eval import eval_
from .quantize import quantize
from .quantize_kv import quantize_kv
from .report import report
from .run import run
from .serve import serve
from .verify import verify


class LlmqGroup(click.Group):
    """Turns every LlmqError/ArtifactError into `error: <one line>` and its exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (LlmqError, ArtifactError) as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(getattr(e, "exit_code", 2))


@click.group(cls=LlmqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmq")
@click.option("--store", envvar="LLMQ_STORE", type=click.Path(file_okay=False),
              help="Artifact store directory (env LLMQ_STORE; default ~/.local/share/llmq/store).")
@click.pass_context
def cli(ctx, store):
    """llmq: quantize, shard, evaluate, serve and benchmark a Hugging Face causal LM, one artifact per stage."""
    ctx.ensure_object(dict)
    ctx.obj["store"] = store


for _cmd in (import_, ls, inspect, lineage, quantize, quantize_kv, build, deploy_, eval_, serve, bench, report, run):
    cli.add_command(_cmd)
cli.add_command(verify)


def main() -> None:
    cli(prog_name="llmq")
