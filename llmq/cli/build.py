"""`llmq build`: shard a model or quantized artifact into a tensor-parallel engine artifact."""

from __future__ import annotations

import click

from ..errors import LlmqError
from ..models import source_artifact
from ..pipeline.build import BuildOptions, build_engine
from ..pipeline.build.stage import KV_CHOICES, TARGETS
from .common import echo_json, get_store, human_bytes


@click.command("build")
@click.argument("ref", required=False)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks: 1, 2, 4 or 8.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel stages (only 1 today).")
@click.option("--target", type=click.Choice(TARGETS), default="llmq", show_default=True,
              help="llmq: rank shards for the bundled runtime; trtllm: a TensorRT-LLM checkpoint (+ engines); "
                   "trtllm-hf: a ModelOpt-style HF checkpoint for TensorRT-LLM's PyTorch backend (trtllm-serve); "
                   "gguf: one .gguf file for llama.cpp / Ollama.")
@click.option("--max-batch-size", type=int, default=64, show_default=True)
@click.option("--max-seq-len", type=int, default=None, help="Default: the model's positions, at most 4096.")
@click.option("--kv", type=click.Choice(KV_CHOICES), default="auto", show_default=True,
              help="KV-cache dtype; int8/fp8 use the scales from `llmq quantize-kv`.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Paged KV-cache block size (tokens).")
@click.option("--pad-heads/--no-pad-heads", default=True, show_default=True,
              help="Pad head counts tp does not divide with zero heads (exact); --no-pad-heads refuses instead.")
@click.option("--parallel-embedding", is_flag=True, help="Split the embedding by vocabulary too.")
@click.option("--verify", is_flag=True, help="Run the reference check (TP logits vs the unsharded model) first.")
@click.option("--name", help="Engine artifact name (default: <source>-tp<N>[-trtllm]).")
@click.option("--json", "as_json", is_flag=True, help="Print the engine manifest as JSON.")
@click.pass_context
def build(ctx, ref, tp, pp, target, max_batch_size, max_seq_len, kv, block_size, pad_heads, parallel_embedding,
          verify, name, as_json):
    """Shard REF (a model or quantized artifact; default: the default model) into an engine artifact."""
    store = get_store(ctx)
    source = source_artifact(ref, store)
    if source.kind not in ("model", "quantized"):
        raise LlmqError(f"{source.ref} is a {source.kind} artifact; build takes a model or quantized artifact")
    opts = BuildOptions(tp=tp, pp=pp, target=target, max_batch_size=max_batch_size, max_seq_len=max_seq_len, kv=kv,
                        block_size=block_size, pad_heads=pad_heads, parallel_embedding=parallel_embedding,
                        verify=verify, name=name)
    art = build_engine(source, store, opts)
    if as_json:
        echo_json(art.manifest)
        return
    m, plan = art.metrics, art.config["plan"]
    click.echo(f"built {art.ref} ({target}, tp={tp}) from {source.ref}: {human_bytes(m['size_bytes'])} at {art.path}")
    click.echo(f"  heads per rank {plan['heads_per_rank']}, KV heads per rank {plan['kv_heads_per_rank']}"
               + (f" (each KV head on {plan['kv_replicas']} ranks)" if plan["kv_replicas"] > 1 else "")
               + (f", padded from {plan['num_heads']} / {plan['num_kv_heads']} to {plan['padded_heads']} / "
                  f"{plan['padded_kv_heads']} heads with zero heads (exact)"
                  if plan["padded_heads"] != plan["num_heads"] else ""))
    if target in ("trtllm", "trtllm-hf"):
        c = m["compile"]
        click.echo(f"  compile: {c['status']}" + (f" ({c['reason']})" if "reason" in c else "")
                   + (f"; serve with (in {art.path}): {c['serve_command']}" if "serve_command" in c else ""))
    if "verify" in m:
        click.echo(f"  reference check: max relative error {m['verify']['max_rel_error']:.2e} "
                   f"(tolerance {m['verify']['tolerance']:g}) passed")
