"""`llmq quantize-kv`: calibrate INT8 / FP8 KV-cache scales for a model or quantized artifact."""

from __future__ import annotations

import sys

import click

from ..models import source_artifact
from ..pipeline.kvcache import KV_TYPES, KVOptions, quantize_kv as run_quantize_kv
from .common import echo_json, get_store


@click.command("quantize-kv")
@click.argument("ref")
@click.option("--kv", "kv", type=click.Choice(KV_TYPES), required=True, help="KV-cache element type.")
@click.option("--per-head", "granularity", flag_value="head", help="One scale per KV head and layer.")
@click.option("--per-tensor", "granularity", flag_value="tensor", help="One scale per layer for K and for V.")
@click.option("--auto", "granularity", flag_value="auto", default=True,
              help="Per head only where it cuts the held-out reconstruction error by >= 10% (default).")
@click.option("--calib", metavar="DATA", help="Calibration text: a .txt/.jsonl file, a directory, or a dataset name "
                              "(default: the bundled offline text).")
@click.option("--num-samples", type=int, default=16, show_default=True, help="Calibration sequences.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per calibration sequence.")
@click.option("--heldout-tokens", type=int, default=2048, show_default=True,
              help="Held-out tokens for the error and KLD measurement.")
@click.option("--device", help="Device for calibration (default: cuda when present, else cpu).")
@click.option("--name", help="Artifact name (default: <source>-kv<int8|fp8>).")
@click.option("--json", "as_json", is_flag=True, help="Print the artifact manifest as JSON.")
@click.pass_context
def quantize_kv(ctx, ref, kv, granularity, calib, num_samples, seq_len, heldout_tokens, device, name, as_json):
    """Calibrate KV-cache scales for REF (a model or quantized artifact) into a new quantized artifact."""
    store = get_store(ctx)
    source = source_artifact(ref, store)
    opts = KVOptions(kv=kv, granularity=granularity, calib=calib, num_samples=num_samples, seq_len=seq_len,
                     heldout_tokens=heldout_tokens, name=name, device=device)
    art = run_quantize_kv(source, store, opts, show_progress=not as_json and sys.stderr.isatty())
    if as_json:
        echo_json(art.manifest)
        return
    m = art.metrics
    err, probe = m["kv_error"], m["probe"]
    click.echo(f"wrote {art.ref} ({kv} KV cache, per {m['granularity']} scales) from {source.ref} at {art.path}")
    click.echo(f"  held-out K/V relative error: per tensor {err['tensor']['kv']:.3g}, per head {err['head']['kv']:.3g}")
    click.echo(f"  vs full-precision cache: mean KLD {probe['kld_mean']:.4g}, top-1 agreement "
               f"{100 * probe['top1']:.2f}% over {probe['tokens']} tokens")
