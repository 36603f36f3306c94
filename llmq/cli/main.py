"""The `llmq` command: a thin shell over the stages. Parse, call, print; no logic here."""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..artifacts import ArtifactError
from ..errors import LlmqError
from .artifacts import import_, inspect, lineage, ls
from .build import build
from .run import run


class LlmqGroup(click.Group):
    """Turns every LlmqError/ArtifactError into `error: <one line>` and its exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (LlmqError, ArtifactError) as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(getattr(e, "exit_code", 2))


def _not_built(name: str, issue: int) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(not built yet: issue #{issue})", add_help_option=False)
    def cmd():
        click.echo(f"error: `llmq {name}` is not built yet (issue #{issue}); see README.md for what works today", err=True)
        sys.exit(2)

    return cmd


@click.group(cls=LlmqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmq")
@click.option("--store", envvar="LLMQ_STORE", type=click.Path(file_okay=False),
              help="Artifact store directory (env LLMQ_STORE; default ~/.local/share/llmq/store).")
@click.pass_context
def cli(ctx, store):
    """llmq: quantize, shard, evaluate, serve and benchmark a Hugging Face causal LM, one artifact per stage."""
    ctx.ensure_object(dict)
    ctx.obj["store"] = store


for _cmd in (import_, ls, inspect, lineage, build, run):
    cli.add_command(_cmd)
for _name, _issue in (("quantize", 3), ("quantize-kv", 3), ("eval", 6), ("serve", 5), ("bench", 7)):
    cli.add_command(_not_built(_name, _issue))


def main() -> None:
    cli(prog_name="llmq")
