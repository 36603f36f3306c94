"""`llmq quantize-kv`: calibrate INT8 / FP8 KV-cache scales for a model or quantized artifact."""

from __future__ import annotations

import sys

import click

from ..models import source_artifact
from ..pipeline.kv_options import KVOptions
from .common import echo_json, get_store
from .options import stage_command


@stage_command("quantize-kv", KVOptions, "Print the artifact manifest as JSON.")
def quantize_kv(ctx, ref, opts, as_json):
    """Calibrate KV-cache scales for REF (a model or quantized artifact; default: the default model) into a new
    quantized artifact."""
    from ..pipeline.kvcache import quantize_kv as run_quantize_kv

    store = get_store(ctx)
    source = source_artifact(ref, store)
    art = run_quantize_kv(source, store, opts, show_progress=not as_json and sys.stderr.isatty())
    if as_json:
        echo_json(art.manifest)
        return
    m = art.metrics
    err, probe = m["kv_error"], m["probe"]
    click.echo(f"wrote {art.ref} ({opts.kv} KV cache, per {m['granularity']} scales) from {source.ref} at {art.path}")
    click.echo(f"  held-out K/V relative error: per tensor {err['tensor']['kv']:.3g}, per head {err['head']['kv']:.3g}")
    click.echo(f"  vs full-precision cache: mean KLD {probe['kld_mean']:.4g}, top-1 agreement "
               f"{100 * probe['top1']:.2f}% over {probe['tokens']} tokens")
