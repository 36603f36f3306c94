"""Connection-level defences around uvicorn's HTTP protocol: a cap on open connections and read deadlines.

uvicorn waits for a request's headers and body for ever (its one timeout is keep-alive, idle between requests), so
clients that send a byte every few seconds, or declare a body they never send, each hold a connection and a file
descriptor until the process runs out of them (and asyncio then logs every failed accept()). `guarded` wraps
uvicorn's protocol class:
- a connection beyond `max_connections` is closed as it is accepted (one warning, then at most one every
  LOG_EVERY seconds, with the count), so descriptors stay well below the process's limit (`fit_descriptors`);
- a request's headers must be complete within `header_timeout` seconds of its first byte (of the connection's
  opening, for its first request), and its body within `body_timeout` seconds of its headers; a byte now and then
  does not extend either. Otherwise the connection is closed (the handler reading the body sees a disconnect).
"""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("llmq.serve")

LOG_EVERY = 10.0  # seconds between two warnings about refused connections
FD_MARGIN = 256  # descriptors kept beyond the connection cap: the model's files, the engine's, the listening socket


class _Refusals:
    """Counts connections refused at the cap and says so in one line, at most every LOG_EVERY seconds."""

    def __init__(self, cap: int):
        self.cap, self.count, self.logged = cap, 0, -math.inf

    def note(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged >= LOG_EVERY:
            log.warning("refused %d connection(s): %d are open, the most --max-connections allows", self.count,
                        self.cap)
            self.count, self.logged = 0, now


def guarded(base: type, max_connections: int, header_timeout: float, body_timeout: float) -> type:
    """uvicorn's HTTP protocol class `base` with the connection cap and the header / body deadlines."""
    refusals = _Refusals(max_connections)

    class Guarded(base):
        _deadline = None  # the pending close, if the client owes us something
        _phase: tuple | None = None  # what it owes: ("headers" | "body", the request cycle it follows / reads)
        _refused = False

        @property
        def receiving_body(self) -> bool:
            return self._phase is not None and self._phase[0] == "body"

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused = True
                refusals.note()
                transport.abort()
                return
            super().connection_made(transport)
            self._expect(("headers", None), header_timeout)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # the next request's headers are on their way
                self._expect(("headers", cycle), header_timeout)
            elif cycle.more_body:
                self._expect(("body", cycle), body_timeout)
            else:  # the whole request is in; the response is the server's business
                self._expect(None, 0.0)

        def _expect(self, phase: tuple | None, seconds: float) -> None:
            if phase == self._phase:
                return  # the same wait goes on: its deadline stands
            self._phase = phase
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = None if phase is None else self.loop.call_later(seconds, self.transport.abort)

    return Guarded


def fit_descriptors(max_connections: int) -> int:
    """Raise this process's soft limit on open files to hold `max_connections` plus FD_MARGIN, as far as the hard
    limit allows; the cap to use (lowered, with one warning, where the hard limit is too low)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(soft - FD_MARGIN, 1)
        log.warning("--max-connections %d lowered to %d: this process may open %d files", max_connections, fitted,
                    soft)
        return fitted
    return max_connections
