"""`llmq build`: shard a model or quantized artifact into a tensor-parallel engine artifact."""

from __future__ import annotations

import click

from ..errors import LlmqError
from ..models import source_artifact
from ..pipeline.targets import BuildOptions, build_engine
from .common import echo_json, get_store, human_bytes
from .options import stage_command


@stage_command("build", BuildOptions, "Print the engine manifest as JSON.")
def build(ctx, ref, opts, as_json):
    """Shard REF (a model or quantized artifact; default: the default model) into an engine artifact."""
    store = get_store(ctx)
    source = source_artifact(ref, store)
    if source.kind not in ("model", "quantized"):
        raise LlmqError(f"{source.ref} is a {source.kind} artifact; build takes a model or quantized artifact")
    art = build_engine(source, store, opts)
    if as_json:
        echo_json(art.manifest)
        return
    m, plan = art.metrics, art.config["plan"]
    click.echo(f"built {art.ref} ({opts.target}, tp={opts.tp}) from {source.ref}: {human_bytes(m['size_bytes'])} "
               f"at {art.path}")
    click.echo(f"  heads per rank {plan['heads_per_rank']}, KV heads per rank {plan['kv_heads_per_rank']}"
               + (f" (each KV head on {plan['kv_replicas']} ranks)" if plan["kv_replicas"] > 1 else "")
               + (f", padded from {plan['num_heads']} / {plan['num_kv_heads']} to {plan['padded_heads']} / "
                  f"{plan['padded_kv_heads']} heads with zero heads (exact)"
                  if plan["padded_heads"] != plan["num_heads"] else ""))
    c = m["compile"]
    if c["status"] != "not-applicable":   # a target with a compile step after its checkpoint
        click.echo(f"  compile: {c['status']}" + (f" ({c['reason']})" if "reason" in c else "")
                   + (f"; serve with (in {art.path}): {c['serve_command']}" if "serve_command" in c else ""))
    if "verify" in m:
        click.echo(f"  reference check: max relative error {m['verify']['max_rel_error']:.2e} "
                   f"(tolerance {m['verify']['tolerance']:g}) passed")
    q = m.get("quality")
    if q and "skipped" not in q:
        rt, cpp = q["llmq_runtime"], q["llama_cpp_modelled"]
        click.echo(f"  KLD vs {q['baseline']} over {q['tokens']} held-out tokens: llmq runtime {rt['kld_mean']:.4g} "
                   f"(top-1 {rt['top1']:.1%}); llama.cpp CPU, modelled {cpp['kld_mean']:.4g} (top-1 {cpp['top1']:.1%})")
    elif q:
        click.echo(f"  quality in llama.cpp not measured: {q['skipped']}")
