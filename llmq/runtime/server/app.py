"""The OpenAI-compatible HTTP front end: FastAPI routes over an EngineLoop.

Handlers tokenize and validate (so every bad request is a 400 before it costs the engine anything), submit to the
engine loop, and turn RequestOutputs into OpenAI response bodies or SSE chunks. A request whose client goes away is
aborted at once, which frees its KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ... import __version__
from ...errors import LlmqError
from ..config import Limits
from ..engine import LLMEngine, RequestOutput
from ..sampling import SamplingParams
from .browser import BrowserGuard
from .engine_loop import EngineLoop, EngineThread, NotAccepting, QueueFull
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def artifact_ref(path: Path) -> str | None:
    """`name/vN` of an artifact directory (`<store>/<name>/v<N>/llmq.json`): what /v1/models reports as `root`, so a
    client with the same store finds the model (and its tokenizer) without the server showing its filesystem."""
    if (path / "llmq.json").is_file() and path.name[1:].isdigit() and path.name.startswith("v"):
        return f"{path.parent.name}/{path.name}"
    return None


class _Frontend:
    """Per-app state: the engine loop, the tokenizer the handlers use, limits."""

    def __init__(self, engine: LLMEngine, name: str, api_key: str | None, max_queue: int,
                 thread: EngineThread | None, limits: Limits):
        from ...models import load_tokenizer

        self.engine = engine
        self.name = name
        self.api_key = api_key
        self.metrics = ServerMetrics(name)
        self.loop = EngineLoop(engine, self.metrics, max_queue=max_queue, thread=thread)
        # a tokenizer of our own: the engine thread decodes with its tokenizer while handlers encode
        self.tokenizer = load_tokenizer(engine.path)
        self.max_model_len = engine.max_model_len
        self.root = artifact_ref(engine.path) or name
        self.vocab_size = engine.spec.vocab_size
        self.created = int(time.time())
        self.limits = limits
        self._token_text: dict[int, str] = {}
        # a text of more characters than this holds more tokens than the context: its longest token's characters
        # (bytes, for byte-level vocabularies) times the context
        self.max_prompt_chars = self.max_model_len * max(map(len, self.tokenizer.get_vocab()))
        # tokenizing and templating run here, off the event loop (the tokenizer releases the GIL); one thread, so
        # requests never use the tokenizer at once
        self.text_thread = ThreadPoolExecutor(1, thread_name_prefix="llmq-tokenize")
        self.waiting: set[asyncio.Queue] = set()  # the output queues of the requests being answered

    def cut(self) -> None:
        """The drain's deadline: every request still waiting for its output gets NotAccepting (a 503, or for a
        stream an error event and [DONE]) and ends."""
        for q in list(self.waiting):
            q.put_nowait(NotAccepting("the server shut down before this request finished (--drain-timeout)"))

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.text_thread, fn, *args)

    def token_text(self, token: int) -> str:
        s = self._token_text.get(token)
        if s is None:
            s = self._token_text[token] = self.tokenizer.decode([token])
        return s

    # -- request preparation ----------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.name):
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.name}`.",
                           param="model", code="model_not_found")

    def check_chars(self, n: int, param: str) -> None:
        """A 400 for text too long for the context whatever its tokens, before tokenizing it (megabytes of text
        take seconds and hundreds of MB to tokenize)."""
        if n > self.max_prompt_chars:
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens; the {param} has {n} "
                       f"characters, more than that many tokens hold.", param, "context_length_exceeded")

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:  # first: the range check below reads every id
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                       f"{len(ids)} tokens.", "prompt", "context_length_exceeded")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise _bad(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return ids

    def params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None) -> SamplingParams:
        if body.n != 1:
            raise _bad("only n=1 is supported", "n")
        lim = self.limits
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > lim.max_stop_strings or any(len(x) > lim.max_stop_chars for x in stop):
            raise _bad(f"at most {lim.max_stop_strings} stop strings of at most {lim.max_stop_chars} characters",
                       "stop")
        if len(body.stop_token_ids or []) > lim.max_stop_strings:
            raise _bad(f"at most {lim.max_stop_strings} stop_token_ids", "stop_token_ids")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       f"completion).", "max_tokens", "context_length_exceeded")
        try:
            temperature = 1.0 if body.temperature is None else body.temperature
            return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                  top_k=-1 if body.top_k in (None, 0) else body.top_k,
                                  top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=stop,
                                  stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                                  logprobs=logprobs)
        except LlmqError as e:
            raise _bad(str(e)) from None

    def submit(self, rid: str, ids: list[int], params: SamplingParams, view=None) -> asyncio.Queue:
        try:
            return self.loop.submit(rid, ids, params, asyncio.get_running_loop(), view)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise APIError(429, f"{e}; retry later", "rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotAccepting as e:
            self.metrics.rejected("unavailable")
            raise APIError(503, str(e), "service_unavailable", code="unavailable") from None

    # -- response pieces ---------------------------------------------------------------------------------------------
    def completion_logprobs(self, lps: list[dict[int, float]], tokens: list[int], offset: int, as_ids: bool) -> dict:
        name = (lambda t: f"token_id:{t}") if as_ids else self.token_text
        texts = [self.token_text(t) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": [name(t) for t in tokens], "token_logprobs": [lp[t] for lp, t in zip(lps, tokens)],
                # as vLLM: the top n plus the sampled token (so logprobs=0 still names it)
                "top_logprobs": [{name(k): v for k, v in _top(lp, len(lp))} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[dict[int, float]], tokens: list[int], n: int, as_ids: bool) -> dict:
        def entry(t, v):
            s = self.token_text(t)
            return {"token": f"token_id:{t}" if as_ids else s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [dict(entry(t, lp[t]), top_logprobs=[entry(k, v) for k, v in _top(lp, n)])
                            for lp, t in zip(lps, tokens)]}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _param(loc) -> str:
    """`prompt` from ('body', 'prompt', 'list[int]', 0): field names only, without pydantic's union-member tags."""
    return ".".join(p for p in loc if isinstance(p, str) and p != "body" and p.isidentifier() and p not in _TYPE_TAGS)


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])[:n]


def _usage(out: RequestOutput) -> dict:
    c = len(out.output_token_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": c,
            "total_tokens": out.num_prompt_tokens + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class _TextDeltas:
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


async def _parse(model: type[BaseModel], request: Request, limit: int):
    """The body as JSON whatever its Content-Type (`curl -d` sends a form type; where the browser guard is on it
    has refused any type but JSON already), validated by `model`; 413 beyond
    `limit` bytes, checked while reading so an oversized body is never held whole."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise _too_large(limit)
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection", code="client_closed") from None
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _body_doc(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


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
        raise _bad(str(item))
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


def create_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, drain_timeout: float = 30.0, thread: EngineThread | None = None,
               limits: Limits = Limits(), allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """An app serving `engine`. Its lifespan starts the engine loop and, at shutdown, drains it for up to
    `drain_timeout` seconds (uvicorn has already waited for open connections by then). The caller owns `engine`
    (and shuts it down), but must not call it while the app runs: the engine loop's thread is then its only user.
    Pass the EngineThread the engine was built on, so the loop runs there (engine_loop.py says why).
    `allowed_hosts`: refuse requests a web page could send (browser.py; `browser.allowed_hosts` says when)."""
    fe = _Frontend(engine, served_model_name or engine.path.name, api_key, max_queue, thread, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(fe.loop.shutdown, drain_timeout)
            fe.text_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmq", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # served below, behind the key
    app.state.frontend = fe
    if allowed_hosts is not None:
        app.add_middleware(BrowserGuard, allowed=allowed_hosts)

    def openapi() -> dict:
        """FastAPI's schema plus the request bodies, which the handlers parse themselves (see _parse)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(s.pop("$defs", {}), **{model.__name__: s})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            msg, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        else:
            param = _param(first.get("loc", ())) or None
            if all(_param(x.get("loc", ())) == (param or "") for x in errs[1:]) and len(errs) > 1:
                msg = f"{param}: {type(first.get('input')).__name__} is none of the accepted types"
            else:
                msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: still an OpenAI-style body (Starlette logs it)
        return JSONResponse(error_body("internal error (see the server's log)", "server_error", code="internal_error"),
                            status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    def auth(request: Request) -> None:
        if fe.api_key is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        # headers arrive as Latin-1 text: back to their bytes, compared with the key's UTF-8
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"),
                                                                 fe.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health():
        if not fe.loop.healthy:
            raise APIError(503, "the engine is not running", "service_unavailable", code="unavailable")
        return Response(status_code=200)

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics():
        return Response(fe.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", dependencies=[Depends(auth)], include_in_schema=False)
    async def openapi_json():
        return JSONResponse(app.openapi())

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": fe.name, "object": "model", "created": fe.created,
                                            "owned_by": "llmq", "root": fe.root,
                                            "max_model_len": fe.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(auth)], openapi_extra=_body_doc(CompletionRequest))
    async def completions(request: Request):
        body = await _parse(CompletionRequest, request, fe.limits.max_body_bytes)
        fe.check_model(body.model)
        for field, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                           ("best_of", body.best_of not in (None, 1))):
            if bad:
                raise _bad(f"{field} is not supported", field)
        p = body.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise _bad("one prompt per request (batch the requests instead)", "prompt")
            p = p[0]
        if isinstance(p, str):
            fe.check_chars(len(p), "prompt")
            p = await fe.off_loop(fe.tokenizer.encode, p)
        ids = fe.check_ids(list(p))
        params = fe.params(body, len(ids), body.max_tokens, 16, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        as_ids = body.return_tokens_as_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text: str, out: RequestOutput, offset: int, final: bool) -> dict:
            lp = None
            if body.logprobs is not None and out.new_logprobs:
                lp = fe.completion_logprobs(out.new_logprobs, out.new_token_ids, offset, as_ids)
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp,
                                 "finish_reason": out.finish_reason if final else None}]}

        def full(out: RequestOutput, lps: list, toks: list[int]) -> dict:
            lp = None if body.logprobs is None else fe.completion_logprobs(lps, toks, 0, as_ids)
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.name,
                    "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": lp}],
                    "usage": _usage(out)}

        return await _respond(fe, request, rid, ids, params, body.stream, include_usage, chunk, None, full)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat(request: Request):
        body = await _parse(ChatCompletionRequest, request, fe.limits.max_body_bytes)
        fe.check_model(body.model)
        if not getattr(fe.tokenizer, "chat_template", None):
            raise _bad("this model's tokenizer has no chat template; use /v1/completions", "messages")
        if len(body.messages) > fe.max_model_len:  # every template spends a token or more on each message
            raise _bad(f"This model's maximum context length is {fe.max_model_len} tokens; the request has "
                       f"{len(body.messages)} messages.", "messages", "context_length_exceeded")
        messages = [m.template_dict() for m in body.messages]
        fe.check_chars(sum(len(m["content"]) for m in messages), "messages")

        def template() -> list[int]:
            try:
                text = fe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template that rejects these messages (e.g. roles out of order)
                raise _bad(f"the chat template rejected the messages: {e}", "messages") from None
            return fe.tokenizer.encode(text, add_special_tokens=False)

        ids = fe.check_ids(await fe.off_loop(template))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        params = fe.params(body, len(ids), max_tokens, None, n_top)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        as_ids = body.return_tokens_as_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def base() -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": fe.name}

        def chunk(text: str, out: RequestOutput, offset: int, final: bool) -> dict:
            lp = None
            if n_top is not None and out.new_logprobs:
                lp = fe.chat_logprobs(out.new_logprobs, out.new_token_ids, n_top, as_ids)
            delta = {"content": text} if text else {}
            return dict(base(), choices=[{"index": 0, "delta": delta, "logprobs": lp,
                                          "finish_reason": out.finish_reason if final else None}])

        first = dict(base(), choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}])
        def full(out: RequestOutput, lps: list, toks: list[int]) -> dict:
            lp = None if n_top is None else fe.chat_logprobs(lps, toks, n_top, as_ids)
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": fe.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason, "logprobs": lp}],
                    "usage": _usage(out)}

        return await _respond(fe, request, rid, ids, params, body.stream, include_usage, chunk, first, full)

    return app


def output_view(stream: bool, stop: list[str]):
    """What the engine thread queues for a handler from each output (EngineLoop.submit's `view`): an output short of
    its last without the text and token ids so far, only its new tokens (a queue of whole outputs grew as the square
    of the tokens for a client that reads slowly: ~100 MB at 4,096 tokens); for a stream, with its text delta."""
    deltas = _TextDeltas(stop) if stream else None

    def view(o: RequestOutput):
        light = o if o.finished else replace(o, text="", output_token_ids=[])
        return (light, deltas(o.text, o.finished)) if stream else light

    return view


async def _respond(fe: _Frontend, request: Request, rid: str, ids: list[int], params: SamplingParams, stream: bool,
                   include_usage: bool, chunk, first: dict | None, full):
    """Run one request: a whole JSON body, or an SSE stream (`first`, then `chunk(...)`s, usage, [DONE]). A stream's
    outputs arrive as (output, text delta) pairs, the deltas worked out on the engine thread."""
    q = fe.submit(rid, ids, params, output_view(stream, params.stop))
    fe.waiting.add(q)

    def close() -> None:
        fe.waiting.discard(q)
        fe.loop.abort(rid)  # no-op when finished; frees the blocks when the client left or we failed

    watcher = asyncio.create_task(_watch_disconnect(request, q))
    handed_over = False
    try:
        out = await _next_output(q)  # wait before answering, so an engine-side error is still a status
        if out is None:
            return Response(status_code=499)
        if not stream:
            lps, toks = list(out.new_logprobs or []), list(out.new_token_ids)
            while not out.finished:
                out = await _next_output(q)
                if out is None:
                    return Response(status_code=499)
                lps += out.new_logprobs or []
                toks += out.new_token_ids
            return JSONResponse(full(out, lps, toks))

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
                last.update(choices=[], usage=_usage(o))
                yield _sse(last)
            yield "data: [DONE]\n\n"

        handed_over = True
        return _AbortingStream(events(), on_close=close)
    finally:
        watcher.cancel()  # a stream watches for the disconnect itself (Starlette cancels it)
        if not handed_over:
            close()
