"""OpenAI-compatible HTTP server over the bundled engine (`llmq serve`)."""

from __future__ import annotations

from ...errors import LlmqError
from ..config import Limits
from .app import create_app
from .engine_loop import EngineLoop, EngineThread

__all__ = ["EngineLoop", "EngineThread", "Limits", "create_app", "make_server", "run_server", "server_config"]

CUT_MARGIN = 0.5  # seconds before uvicorn's drain deadline that what still runs is answered


def make_server(config):
    """uvicorn's server for `config` (see server_config), whose drain answers what still runs CUT_MARGIN seconds
    before uvicorn would cancel it (a cancelled handler sends nothing and logs a traceback): a stream gets an error
    event and [DONE], a request waiting for its output a 503, a request whose body is still arriving is dropped."""
    import asyncio

    import uvicorn

    frontend = config.app.state.frontend   # (uvicorn types config.app as any ASGI callable: no .state)

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            timeout = self.config.timeout_graceful_shutdown
            if timeout is not None:
                asyncio.get_running_loop().call_later(max(timeout - CUT_MARGIN, timeout / 2), self._cut)
            await super().shutdown(sockets)

        def _cut(self) -> None:
            for conn in list(self.server_state.connections):
                if getattr(conn, "receiving_body", False):
                    conn.transport.abort()
            frontend.cut()

    return _Server(config)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                  log_level: str = "info", max_connections: int | None = None):
    """uvicorn's configuration for `app`: its Limits' timeouts and connection cap (`max_connections` overrides the
    cap) on uvicorn's HTTP protocol (connections.py)."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    from .connections import guarded

    lim = app.state.frontend.limits
    http = guarded(import_from_string(HTTP_PROTOCOLS["auto"]), max_connections or lim.max_connections,
                   lim.header_timeout, lim.body_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=http,
                          timeout_keep_alive=lim.keep_alive_timeout, timeout_graceful_shutdown=drain_timeout)


def run_server(app, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
               log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; uvicorn then stops accepting, waits up to `drain_timeout` for open requests and
    runs the app's shutdown (the engine loop's drain). When the engine fails for good, stop too and raise, so the
    process exits non-zero and a supervisor restarts it."""
    import signal
    import threading

    from .connections import fit_descriptors

    config = server_config(app, host, port, drain_timeout, log_level,
                           fit_descriptors(app.state.frontend.limits.max_connections))
    # uvicorn re-raises the signal that stopped it once it has drained; with the default handlers in place that
    # would kill the process before the caller can shut the engine's TP workers down, so catch it quietly instead
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    server = make_server(config)
    loop = app.state.frontend.loop
    loop.on_fatal = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    if loop.error is not None:
        raise LlmqError(f"the engine failed: {loop.error}")
