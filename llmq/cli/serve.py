"""`llmq serve`: the bundled continuous-batching runtime behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

from dataclasses import replace

import click

from ..errors import LlmqError
from ..models import source_artifact
from ..runtime.config import EngineConfig, Limits, ServerOptions
from .common import get_store, human_bytes
from .options import stage_options


@click.command("serve")
@click.argument("ref", required=False)
@stage_options(ServerOptions, "server")
@stage_options(EngineConfig, "config")
@stage_options(Limits, "limits")
@click.pass_context
def serve(ctx, ref, server: ServerOptions, config: EngineConfig, limits: Limits):
    """Serve REF (an engine, quantized or model artifact, or a model reference; default: the default model)."""
    from ..runtime import LLMEngine
    from ..runtime.kv_cache import kv_element_bytes
    from ..runtime.server import EngineThread, create_app, run_server
    from ..runtime.server.browser import allowed_hosts as hosts_for

    for opts in (server, config, limits):
        opts.check()
    host, port, api_key = server.host, server.port, server.api_key
    _check_bindable(host, port)  # before minutes of model loading, not after
    thread = EngineThread()  # builds and drives the engine: torch work stays on this one thread
    art = thread.call(source_artifact, ref, get_store(ctx))
    if art.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"{art.ref} is a {art.kind} artifact; serve takes a model, quantized or engine artifact")
    engine = thread.call(LLMEngine, art.path, replace(config, **thread.call(config.engine_fields, get_store(ctx))))
    app = None
    try:
        name = server.served_model_name or art.name
        app = create_app(engine, served_model_name=name, api_key=api_key, max_queue=server.max_queue,
                         drain_timeout=server.drain_timeout, thread=thread, limits=limits,
                         allowed_hosts=hosts_for(host, api_key, server.allowed_hosts))
        kv_bytes = engine.num_blocks * engine.block_size * engine.spec.kv_bytes_per_token(
            kv_element_bytes(engine.kv_cache_dtype, engine.runner.dtype), engine.tp)
        click.echo(f"serving {name} ({art.ref}, {art.kind}) on http://{host}:{port}/v1  device={engine.device} "
                   f"tp={engine.tp} context={engine.max_model_len}  KV cache: {engine.num_blocks} blocks of "
                   f"{engine.block_size} tokens ({engine.kv_cache_dtype}, {human_bytes(kv_bytes)} "
                   f"per rank)" + (f"  speculative: {config.speculative} k={config.num_speculative_tokens} (off "
                                   f"above {config.speculative_max_batch} running)" if config.speculative else ""),
                   err=True)
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            click.echo(f"warning: listening on {host} without --api-key", err=True)
        run_server(app, host=host, port=port, drain_timeout=server.drain_timeout, log_level=server.log_level)
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
