"""`llmq quantize`: weights to INT8 / INT4 / FP8 with RTN, GPTQ, AWQ, SmoothQuant (W8A8) or FP8."""

from __future__ import annotations

import sys

import click

from ..models import source_artifact
from ..pipeline.quantize import METHODS, QuantizeOptions, quantize as run_quantize
from .common import echo_json, get_store, human_bytes


@click.command("quantize")
@click.argument("model", required=False)
@click.option("--bits", type=int, default=8, show_default=True, help="Weight bits: 4 or 8.")
@click.option("--method", type=click.Choice(METHODS), default="rtn", show_default=True,
              help="rtn: round-to-nearest; gptq / awq: calibrated weight-only; smoothquant: W8A8; fp8: FP8 E4M3.")
@click.option("--group-size", type=int, default=None,
              help="Input columns per scale; 0 or -1 = per output channel. Default: 128 at 4 bits, per channel at 8.")
@click.option("--sym/--asym", "symmetric", default=True, show_default=True, help="Symmetric or zero-point grid.")
@click.option("--per-tensor", is_flag=True, help="One scale per weight tensor (rtn, fp8).")
@click.option("--act-order", is_flag=True, help="GPTQ: quantize columns by decreasing Hessian diagonal.")
@click.option("--damp", type=float, default=0.01, show_default=True, help="GPTQ: damping, fraction of mean diag(H).")
@click.option("--alpha", type=float, default=0.5, show_default=True, help="SmoothQuant migration strength.")
@click.option("--activations", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True,
              help="W8A8 / FP8: per-token activation scales at run time, or static ones from calibration.")
@click.option("--calib", metavar="DATA", help="Calibration text: .txt / .jsonl file, directory, or dataset name "
              "(network). Default: bundled offline text.")
@click.option("--num-samples", type=int, default=32, show_default=True, help="Calibration windows.")
@click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per calibration window.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for choosing calibration windows.")
@click.option("--probe-tokens", type=int, default=2048, show_default=True,
              help="Held-out tokens for the KLD / top-1 quality probe (0: skip it).")
@click.option("--name", help="Artifact name (default: <model>-<method>-w<bits>[g<group>]).")
@click.option("--device", help="Device to calibrate on (default: cuda when available, else cpu).")
@click.option("--json", "as_json", is_flag=True, help="Print the artifact manifest as JSON.")
@click.pass_context
def quantize(ctx, model, bits, method, group_size, symmetric, per_tensor, act_order, damp, alpha, activations, calib,
             num_samples, seq_len, seed, probe_tokens, name, device, as_json):
    """Quantize MODEL (a model artifact, HF directory, .gguf or hub id; default: the default model)."""
    store = get_store(ctx)
    source = source_artifact(model, store)
    opts = QuantizeOptions(bits=bits, method=method, group_size=group_size, symmetric=symmetric,
                           per_tensor=per_tensor, act_order=act_order, damp=damp, alpha=alpha, activations=activations,
                           calib=calib, num_samples=num_samples, seq_len=seq_len, seed=seed,
                           probe_tokens=probe_tokens, name=name, device=device)
    art = run_quantize(source, opts, store, progress=not as_json and sys.stderr.isatty())
    if as_json:
        echo_json(art.manifest)
        return
    m, c = art.metrics, art.config
    click.echo(f"quantized {source.ref} -> {art.ref} ({c['scheme']}, {method}) at {art.path}")
    click.echo(f"  size {human_bytes(m['size_bytes'])}: {m['ratio_vs_bf16']:.2f}x smaller than bf16 "
               f"({m['linear_ratio_vs_bf16']:.2f}x for the quantized linears); excluded: {', '.join(c['excluded_modules'])}")
    if c.get("calibration"):
        cal = c["calibration"]
        click.echo(f"  calibration: {cal['samples']} x {cal['seq_len']} tokens from {cal['source'][:80]}")
    if "probe" in m:
        p = m["probe"]
        click.echo(f"  probe vs source ({p['tokens']} tokens): mean KLD {p['kld_mean']:.5f}, top-1 {100 * p['top1']:.2f}%")
    click.echo(f"  wall {m['wall_time_s']:.1f} s, peak RSS {human_bytes(m['peak_rss_bytes'])}")
