"""The one thread that owns the LLMEngine, and the thread-safe doorway the asyncio server talks to it through.

LLMEngine is single-threaded by design, so every call into it (add, abort, step, stats) happens here. Handlers put
commands on a queue; the loop applies them between steps, so an abort frees its KV blocks before the next step.
Outputs go back to each request's asyncio.Queue through loop.call_soon_threadsafe.

The loop runs on an `EngineThread`. Build the engine on that same thread (`EngineThread.call(LLMEngine, ...)`) and
keep torch work off every other thread: on CPU each thread that runs OpenMP work gets a team of its own, and once
two teams exist on a small machine libgomp stops spinning between parallel regions, so every small op pays a wake-up
(measured here: a decode-sized oneDNN linear took 50 us on the thread that owned the only team, 120 us on a second
thread after the main thread had loaded the model; batch-1 decode through `llmq serve` ran at 17 instead of 27 tok/s).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ...errors import LlmqError
from ..engine import LLMEngine, RequestOutput, StepFailed
from ..sampling import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("llmq.serve")

# forward passes failing back to back: the engine itself can no longer run (a dead TP worker, a broken device)
FATAL_STEP_FAILURES = 3
# seconds the engine thread gets to stop once the drain is over: a step's worth (a step stuck for good: never)
STOP_WAIT = 10.0


class QueueFull(Exception):
    """More requests in flight than running slots plus the waiting queue hold."""


class NotAccepting(Exception):
    """The server is draining for shutdown, or the engine failed."""


class EngineThread:
    """The one thread that builds and then drives an engine (see the module docstring for why it must be one).
    A daemon thread, like the engine loop always was: a loop nobody stopped must not hold the process open."""

    def __init__(self):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="llmq-engine", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)

    def submit(self, fn) -> Future:
        fut: Future = Future()
        self._work.put((fn, fut))
        return fut

    def call(self, fn, *args, **kwargs):
        """Run fn on the engine thread and return its result (or raise its exception) here."""
        return self.submit(lambda: fn(*args, **kwargs)).result()

    def close(self) -> None:
        self._work.put(None)


@dataclass
class _Live:
    sink: Callable[[object], None]
    arrival: float
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int = 256,
                 thread: EngineThread | None = None):
        if max_queue < 0:
            raise LlmqError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.max_num_seqs + max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and neither finished nor aborted; guarded by _lock
        self._accepting = True
        self.error: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # called on the engine thread once the engine has failed
        self._live: dict[str, _Live] = {}  # engine thread only
        self._own_thread = thread is None
        self._thread = thread or EngineThread()
        self._running: Future | None = None
        self.stuck = False  # shutdown gave up on an engine thread stuck in a step; nobody can call the engine now

    # -- called from the asyncio side -----------------------------------------------------------------------------
    def start(self) -> None:
        self.metrics.set_baseline(self.engine.stats())
        self._running = self._thread.submit(self._run)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._alive()

    def _alive(self) -> bool:
        return self._running is not None and not self._running.done()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop, view: Callable[[RequestOutput], object] | None = None,
               images=None) -> asyncio.Queue:
        """Queue a request; its RequestOutputs (or one exception) arrive on the returned queue, each passed through
        `view` first when given: on the engine thread, so that per-output work stays off the event loop."""
        with self._lock:
            if not self._accepting or not self.healthy:
                raise NotAccepting("the server is shutting down" if self.healthy else "the engine has failed")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests in flight; the queue is full")
            self._in_flight += 1
            out: asyncio.Queue = asyncio.Queue()

            def sink(item: object) -> None:
                if view is not None and isinstance(item, RequestOutput):
                    try:
                        item = view(item)
                    except Exception as e:  # this request's failure alone (a 500 or an in-band error)
                        item = e
                try:
                    loop.call_soon_threadsafe(out.put_nowait, item)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    pass

            # under the lock, so a failing loop (which empties the inbox under it) cannot strand this request
            self._inbox.put(("add", request_id, prompt_ids, params, sink, time.monotonic(), images))
        return out

    def abort(self, request_id: str) -> None:
        """Free the request's KV blocks before the next step; a no-op when it already finished."""
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` seconds, abort the rest, stop. An engine
        thread that has not stopped STOP_WAIT seconds later is stuck in a step: it is left behind (`stuck`; a daemon
        thread, it does not hold the process open) rather than waited on for ever."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while self._in_flight and self._alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._alive():
            self._inbox.put(("stop",))
            try:
                self._running.result(timeout=STOP_WAIT)
            except TimeoutError:
                self.stuck = True
                log.error("the engine did not stop within %.0f s of the drain (stuck in a step); exiting without it",
                          STOP_WAIT)
        if self._own_thread:
            self._thread.close()

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _done(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        with self._lock:
            self._in_flight -= 1

    def _command(self, cmd: tuple) -> bool:
        """Apply one command; False means stop."""
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, sink, arrival, images = cmd
            try:
                self.engine.add_request(rid, ids, params, images)
            except Exception as e:  # LlmqError: a 400 for this request alone; anything else: a 500
                with self._lock:
                    self._in_flight -= 1
                sink(e)
                return True
            self._live[rid] = _Live(sink, arrival)
        elif kind == "abort":
            rid = cmd[1]
            if rid in self._live:
                self.engine.abort_request(rid)
                self.metrics.finished("abort")
                self._done(rid)
        elif kind == "stop":
            for rid, live in list(self._live.items()):
                self.engine.abort_request(rid)
                self.metrics.finished("abort")
                live.sink(NotAccepting("the server shut down before this request finished"))
                self._done(rid)
            return False
        return True

    def _deliver(self, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        m = self.metrics
        n = len(out.new_token_ids)
        if live.last_token is None:
            if out.metrics.first_token_time is not None:
                m.ttft.observe(out.metrics.first_token_time - live.arrival)
        elif n:
            gap = (now - live.last_token) / n
            for _ in range(n):
                m.itl.observe(gap)
                m.tpot.observe(gap)
        live.last_token = now
        live.sink(out)
        if out.finished:
            end = out.metrics.finished_time or now
            m.e2e.observe(end - live.arrival)
            n_out = len(out.output_token_ids)
            m.request_prompt_tokens.observe(out.num_prompt_tokens)
            m.request_generation_tokens.observe(n_out)
            if n_out > 1 and out.metrics.first_token_time is not None:
                m.request_tpot.observe((end - out.metrics.first_token_time) / (n_out - 1))
            m.finished(out.finish_reason or "stop")
            self._done(out.request_id)

    def _fail_requests(self, e: StepFailed) -> None:
        """Answer the requests the engine failed (it has freed their blocks); the others carry on."""
        log.error("engine step failed for %d request(s): %s", len(e.failed), e, exc_info=e.__cause__)
        for rid, err in e.failed.items():
            live = self._live.get(rid)
            if live is not None:
                live.sink(RuntimeError(f"this request failed in the engine: {err}"))
                self.metrics.finished("error")
                self._done(rid)

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None

    def _step(self, failures: int) -> int:
        """One engine step, its outputs delivered; returns the failed steps in a row. A method, so that no output
        (and the prompt log-probabilities it may hold) outlives the step while the loop waits for work."""
        try:
            outs = self.engine.step()
            failures = 0
        except StepFailed as e:
            outs = e.outputs
            failures = failures + 1 if e.whole_batch else 0
            self._fail_requests(e)
            if failures >= FATAL_STEP_FAILURES:
                raise RuntimeError(f"{failures} engine steps in a row failed: {e}") from e
        now = time.monotonic()
        for out in outs:
            self._deliver(out, now)
        return failures

    def _run(self) -> None:
        eng = self.engine
        failures = 0
        try:
            running = True
            while running:
                cmd = self._next_command(block=not eng.has_unfinished())  # sleep only when there is nothing to run
                while cmd is not None and running:
                    running = self._command(cmd)
                    cmd = self._next_command(block=False) if running else None
                if running and eng.has_unfinished():
                    failures = self._step(failures)
                self.metrics.update(eng.stats())
        except BaseException as e:  # a bug or a dead TP worker: fail every request, never hang the clients
            log.exception("engine loop failed")
            failed = RuntimeError(f"the engine failed: {e}")
            for rid, live in list(self._live.items()):
                try:
                    self.engine.abort_request(rid)  # bookkeeping only: frees the blocks even of a broken engine
                finally:
                    live.sink(failed)
                    self._done(rid)
            with self._lock:
                self.error = e
                while (cmd := self._next_command(block=False)) is not None:
                    if cmd[0] == "add":
                        self._in_flight -= 1
                        cmd[4](failed)
            if self.on_fatal is not None:
                self.on_fatal()
