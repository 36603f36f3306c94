"""Answering a request: a whole JSON body, or an SSE stream whose text deltas never take back what they sent (an
unfinished UTF-8 character or a possible stop string is held back). A request whose client goes away is aborted
at once, which frees its KV blocks before the engine's next step."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ...errors import LlmqError
from ..engine import RequestOutput
from ..host_memory import release_free_heap
from ..sampling import SamplingParams
from .engine_loop import NotAccepting
from .frontend import Frontend
from .protocol import APIError, bad_request

TRIM_ENTRIES = 1 << 16  # log-probabilities in an answer past which its freed heap is handed back to the OS


def usage(out: RequestOutput) -> dict:
    c = len(out.output_token_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": c,
            "total_tokens": out.num_prompt_tokens + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class TextDeltas:
    """Streams text that will not change: holds back an unfinished UTF-8 character and anything that could still
    turn into a stop string (the engine cuts the text at a stop string once it is complete).

    Each stop string has a Knuth-Morris-Pratt matcher fed only the new characters, so a stream costs time linear
    in its text and stop strings, however long they are."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.borders: list[list[int]] | None = None  # built on first use, on the engine thread
        self.matched = [0] * len(stop)  # per stop: the longest prefix of it that the text fed so far ends with
        self.hold = 0  # trailing characters of the text fed so far that may begin a stop string
        self.fed = 0
        self.sent = 0

    def __call__(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            if end > self.fed:
                self._feed(text[self.fed:end])
                self.fed = end
            end = min(end, self.fed) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece

    def _feed(self, new: str) -> None:
        """Advance every matcher over `new` and recompute the hold-back."""
        if self.borders is None:
            self.borders = [_borders(s) for s in self.stop]
        hold = 0
        for i, (s, border) in enumerate(zip(self.stop, self.borders)):
            q, n = self.matched[i], len(s)
            for c in new:
                while q and (q == n or s[q] != c):
                    q = border[q - 1]
                if s[q] == c:
                    q += 1
            self.matched[i] = q
            hold = max(hold, border[q - 1] if q == n else q)
        self.hold = hold


def _borders(s: str) -> list[int]:
    """KMP's failure function: for each i, the length of the longest proper prefix of s[:i+1] that ends it."""
    out, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out


async def _next_output(q: asyncio.Queue) -> RequestOutput | None:
    """The next output, or None once the client has disconnected (see _watch_disconnect)."""
    item = await q.get()
    return None if item is None else _raise_if_error(item)


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Wake the handler with None when the client goes away (the body is read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    q.put_nowait(None)


def _raise_if_error(item: object) -> RequestOutput:
    if isinstance(item, LlmqError):
        raise bad_request(str(item))
    if isinstance(item, NotAccepting):
        raise APIError(503, str(item), "service_unavailable", code="unavailable")
    if isinstance(item, BaseException):
        raise APIError(500, str(item), "internal_error", code="engine_failed")
    return item


class _AbortingStream(StreamingResponse):
    """SSE response that aborts its request however it ends: finished, cancelled by a disconnect, or failed."""

    def __init__(self, body: AsyncIterator[str], on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def output_view(stream: bool, stop: list[str]):
    """What the engine thread queues for a handler from each output (EngineLoop.submit's `view`): an output short of
    its last without the text and token ids so far, only its new tokens (a queue of whole outputs grew as the square
    of the tokens for a client that reads slowly: ~100 MB at 4,096 tokens); for a stream, with its text delta."""
    deltas = TextDeltas(stop) if stream else None

    def view(o: RequestOutput):
        light = o if o.finished else replace(o, text="", output_token_ids=[])
        return (light, deltas(o.text, o.finished)) if stream else light

    return view


async def respond(fe: Frontend, request: Request, rid: str, ids: list[int], params: SamplingParams, stream: bool,
                  include_usage: bool, chunk, first: dict | None, full, images=None):
    """Run one request: a whole JSON body (`full(last output, logprobs, tokens, the first output's prompt_logprobs)`),
    or an SSE stream (`first`, then `chunk(...)`s, usage, [DONE]). A stream's outputs arrive as (output, text delta)
    pairs, the deltas worked out on the engine thread."""
    q = fe.submit(rid, ids, params, output_view(stream, params.stop), images)
    fe.waiting.add(q)

    def close() -> None:
        fe.waiting.discard(q)
        fe.settle(rid)
        fe.loop.abort(rid)  # no-op when finished; frees the blocks when the client left or we failed

    watcher = asyncio.create_task(_watch_disconnect(request, q))
    handed_over = False
    try:
        out = await _next_output(q)  # wait before answering, so an engine-side error is still a status
        if out is None:
            return Response(status_code=499)
        if not stream:
            lps, toks, prompt = list(out.new_logprobs or []), list(out.new_token_ids), out.prompt_logprobs
            while not out.finished:
                out = await _next_output(q)
                if out is None:
                    return Response(status_code=499)
                lps += out.new_logprobs or []
                toks += out.new_token_ids
            # off the event loop: an answer of many log-probabilities takes a while to build and encode, and leaves
            # freed heap behind that glibc would keep: handed back once the answer is sent
            after = BackgroundTask(release_free_heap) if fe.owing.get(rid, 0) > TRIM_ENTRIES else None
            return await asyncio.to_thread(lambda: JSONResponse(full(out, lps, toks, prompt), background=after))

        async def events() -> AsyncIterator[str]:
            offset, (o, text) = 0, out
            if first is not None:
                yield _sse(first)
            while True:
                if text or o.finished or (params.logprobs is not None and o.new_token_ids):
                    yield _sse(chunk(text, o, offset, o.finished))
                offset += len(text)
                if o.finished:
                    break
                try:
                    item = await _next_output(q)
                except APIError as e:  # the status line is long gone: report in-band, as OpenAI does
                    yield _sse(e.body)
                    yield "data: [DONE]\n\n"
                    return
                if item is None:  # the client left as the stream began
                    return
                o, text = item
            if include_usage:
                last = chunk("", o, offset, False)
                last.update(choices=[], usage=usage(o))
                yield _sse(last)
            yield "data: [DONE]\n\n"

        handed_over = True
        return _AbortingStream(events(), on_close=close)
    finally:
        watcher.cancel()  # a stream watches for the disconnect itself (Starlette cancels it)
        if not handed_over:
            close()
