"""`llmq serve`: the bundled continuous-batching runtime behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import click

from ..errors import LlmqError
from ..models import source_artifact
from ..options import SpeculativeOptions, parse_size
from ..pipeline.targets.stage import KV_CHOICES
from .common import get_store, human_bytes
from .options import stage_options


@click.command("serve")
@click.argument("ref", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks (one process each).")
@click.option("--kv-cache-memory", help="KV-cache budget per rank, e.g. 512MiB or 2GiB (overrides the fraction).")
@click.option("--kv-cache-fraction", type=float, default=None,
              help="Fraction of free memory for the KV cache when no size is given  [default: 0.25].")
@click.option("--kv", type=click.Choice(KV_CHOICES), default="auto", show_default=True,
              help="KV-cache dtype. auto: the compute dtype, or the checkpoint's calibrated KV scheme.")
@click.option("--kv-cache-dtype", "kv", type=click.Choice(KV_CHOICES), hidden=True)
@click.option("--max-batch-size", type=int, default=64, show_default=True, help="Sequences in the running batch.")
@click.option("--max-num-seqs", "max_batch_size", type=int, hidden=True)
@click.option("--max-num-batched-tokens", type=int, default=512, show_default=True,
              help="Tokens per engine step (chunked prefill budget).")
@click.option("--max-seq-len", type=int, default=None,
              help="Context length (default: the model's, at most 4096).")
@click.option("--max-model-len", "max_seq_len", type=int, hidden=True)
@click.option("--block-size", type=int, default=16, show_default=True, help="Paged KV-cache block size (tokens).")
@click.option("--no-prefix-caching", is_flag=True, help="Turn off automatic prefix caching.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Compute dtype (default: float32 on CPU, the checkpoint's 16-bit dtype on GPU).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile the decode step (tp 1; the first batches of each shape wait for compilation).")
@click.option("--int8-activations", is_flag=True,
              help="INT4 / INT8 weight-only products with activations rounded to int8 per block of 32 (llama.cpp's "
                   "Q8_0 arithmetic; x86 CPUs with AVX512-VNNI): ~2x faster decode, a little less accurate than what "
                   "quantize's probe and eval measured.")
@click.option("--served-model-name", help="Model id in the API (default: the artifact's name).")
@click.option("--api-key", envvar="LLMQ_API_KEY",
              help="Require `Authorization: Bearer KEY` on /v1, /metrics and /openapi.json (env LLMQ_API_KEY).")
@click.option("--allowed-hosts",
              help="Host names requests may be addressed to, comma-separated ('*': any), e.g. a proxy's public name. "
                   "Also refuses cross-origin requests and non-JSON POSTs. Default: the loopback names on a loopback "
                   "--host without --api-key, any elsewhere.")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests allowed to wait beyond the running batch; more get 429.")
@click.option("--max-stop-strings", type=int, default=16, show_default=True,
              help="Most stop strings (and stop_token_ids) one request may give; more get 400.")
@click.option("--max-stop-length", type=int, default=1024, show_default=True,
              help="Longest stop string in characters; longer get 400.")
@click.option("--max-body-size", default="8MiB", show_default=True, help="Largest request body; larger get 413.")
@click.option("--header-timeout", type=float, default=10.0, show_default=True,
              help="Seconds a client has to send a request's headers; slower connections are closed.")
@click.option("--body-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a client has to send a request's body once its headers are in.")
@click.option("--keep-alive-timeout", type=float, default=5.0, show_default=True,
              help="Seconds an idle connection stays open between requests.")
@click.option("--max-connections", type=int, default=1024, show_default=True,
              help="Connections open at once; more are closed as they arrive (one log line).")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="Seconds to let in-flight requests finish on SIGTERM / Ctrl-C.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@stage_options(SpeculativeOptions)
@click.pass_context
def serve(ctx, ref, host, port, tp, kv_cache_memory, kv_cache_fraction, kv, max_batch_size,
          max_num_batched_tokens, max_seq_len, block_size, no_prefix_caching, dtype, device, compile_,
          int8_activations, served_model_name, api_key, allowed_hosts, max_queue, max_stop_strings, max_stop_length,
          max_body_size,
          header_timeout, body_timeout, keep_alive_timeout, max_connections, drain_timeout, log_level, opts):
    """Serve REF (an engine, quantized or model artifact, or a model reference; default: the default model)."""
    from ..runtime import EngineConfig, LLMEngine
    from ..runtime.kv_cache import kv_element_bytes
    from ..runtime.server import EngineThread, Limits, create_app, run_server
    from ..runtime.server.browser import allowed_hosts as hosts_for

    if kv_cache_memory is not None and kv_cache_fraction is not None:
        raise LlmqError("give --kv-cache-memory or --kv-cache-fraction, not both")
    if max_queue < 0:
        raise LlmqError(f"--max-queue must be >= 0, got {max_queue}")
    if min(max_stop_strings, max_stop_length) < 0:
        raise LlmqError("--max-stop-strings and --max-stop-length must be >= 0")
    if min(header_timeout, body_timeout, keep_alive_timeout) <= 0 or max_connections < 1:
        raise LlmqError("--header-timeout, --body-timeout and --keep-alive-timeout must be > 0, --max-connections >= 1")
    limits = Limits(max_stop_strings, max_stop_length, parse_size(max_body_size), header_timeout, body_timeout,
                    keep_alive_timeout, max_connections)
    opts.check()
    _check_bindable(host, port)  # before minutes of model loading, not after
    thread = EngineThread()  # builds and drives the engine: torch work stays on this one thread
    art = thread.call(source_artifact, ref, get_store(ctx))
    if art.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"{art.ref} is a {art.kind} artifact; serve takes a model, quantized or engine artifact")
    cfg = EngineConfig(max_num_seqs=max_batch_size, max_num_batched_tokens=max_num_batched_tokens,
                       max_model_len=max_seq_len, block_size=block_size,
                       kv_cache_memory=parse_size(kv_cache_memory) if kv_cache_memory else None,
                       kv_cache_dtype=kv, enable_prefix_caching=not no_prefix_caching, tp=tp,
                       device=device, dtype=dtype, compile=compile_, int8_activations=int8_activations,
                       **thread.call(opts.engine_fields, get_store(ctx)))
    if kv_cache_fraction is not None:
        cfg.kv_cache_fraction = kv_cache_fraction
    engine = thread.call(LLMEngine, art.path, cfg)
    app = None
    try:
        name = served_model_name or art.name
        app = create_app(engine, served_model_name=name, api_key=api_key, max_queue=max_queue,
                         drain_timeout=drain_timeout, thread=thread, limits=limits,
                         allowed_hosts=hosts_for(host, api_key, allowed_hosts))
        kv_heads = max(engine.spec.num_kv_heads // engine.tp, 1)
        kv_bytes = (engine.num_blocks * engine.block_size * 2 * engine.spec.num_layers * kv_heads
                    * engine.spec.head_dim * kv_element_bytes(engine.kv_cache_dtype, engine.runner.dtype))
        click.echo(f"serving {name} ({art.ref}, {art.kind}) on http://{host}:{port}/v1  device={engine.device} "
                   f"tp={engine.tp} context={engine.max_model_len}  KV cache: {engine.num_blocks} blocks of "
                   f"{engine.block_size} tokens ({engine.kv_cache_dtype}, {human_bytes(kv_bytes)} "
                   f"per rank)" + (f"  speculative: {opts.speculative} k={opts.num_speculative_tokens} (off above "
                                   f"{opts.speculative_max_batch} running)" if opts.speculative else ""), err=True)
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            click.echo(f"warning: listening on {host} without --api-key", err=True)
        run_server(app, host=host, port=port, drain_timeout=drain_timeout, log_level=log_level)
    finally:
        if app is None or not app.state.frontend.loop.stuck:  # a stuck engine thread would never run it
            thread.call(engine.shutdown)
        thread.close()


def _check_bindable(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise LlmqError(f"cannot resolve --host {host}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as e:
            raise LlmqError(f"cannot listen on {host}:{port}: {e.strerror}") from None
