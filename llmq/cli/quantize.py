"""`llmq quantize`: weights to INT8 / INT4 / FP8 / FP4 with RTN, GPTQ, AWQ, SmoothQuant (W8A8), FP8, NVFP4 or MXFP4."""

from __future__ import annotations

import sys

import click

from ..models import source_artifact
from ..pipeline.quantize import QuantizeOptions
from ..pipeline.quantize import quantize as run_quantize
from .common import echo_json, get_store, human_bytes
from .options import stage_command


@stage_command("quantize", QuantizeOptions, "Print the artifact manifest as JSON.", arg="model")
def quantize(ctx, model, opts, as_json):
    """Quantize MODEL (a model artifact, HF directory, .gguf or hub id; default: the default model)."""
    store = get_store(ctx)
    source = source_artifact(model, store)
    art = run_quantize(source, opts, store, progress=not as_json and sys.stderr.isatty())
    if as_json:
        echo_json(art.manifest)
        return
    m, c = art.metrics, art.config
    click.echo(f"quantized {source.ref} -> {art.ref} ({c['scheme']}, {opts.method}) at {art.path}")
    click.echo(f"  size {human_bytes(m['size_bytes'])}: {m['ratio_vs_bf16']:.2f}x smaller than bf16 "
               f"({m['linear_ratio_vs_bf16']:.2f}x for the quantized linears); excluded: "
               f"{', '.join(c['excluded_modules']) or 'none'}")
    if c.get("grid", "int") != "int":
        fallbacks = "".join(f"; {fb['linears']} as {fb['scheme']}: {fb['why']}" for fb in c["grid_fallback"]
                            if fb["linears"])
        click.echo(f"  {c['grid_linears']} linears on the {c['grid'].upper()} grid{fallbacks}")
    if c.get("calibration"):
        cal = c["calibration"]
        click.echo(f"  calibration: {cal['samples']} x {cal['seq_len']} tokens from {cal['source'][:80]}")
    if "probe" in m:
        p = m["probe"]
        click.echo(f"  probe vs source ({p['tokens']} tokens): mean KLD {p['kld_mean']:.5f}, "
                   f"top-1 {100 * p['top1']:.2f}%")
    gpu = f", peak GPU memory {human_bytes(m['peak_device_bytes'])}" if "peak_device_bytes" in m else ""
    click.echo(f"  wall {m['wall_time_s']:.1f} s, peak RSS {human_bytes(m['peak_rss_bytes'])}{gpu}")
