"""The OpenAI-compatible HTTP front end: FastAPI routes over an EngineLoop.

Handlers read and validate the body (parsing.py) and the request (frontend.py), so every bad request is a 400 before
it costs the engine anything, then submit it and answer with a JSON body or an SSE stream (streaming.py).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...errors import LlmqError
from ...models.chat import TemplateError
from ..config import Limits
from ..engine import LLMEngine, RequestOutput
from ..sampling import PromptLogprobs
from .browser import BrowserGuard
from .engine_loop import EngineThread
from .frontend import Frontend
from .metrics import CONTENT_TYPE
from .page import add_page
from .parsing import body_doc, read_body, validation_message
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, error_body
from .streaming import respond, usage
from .tools import ChatAnswer, plan_tools, prepare_tools


def create_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, drain_timeout: float = 30.0, thread: EngineThread | None = None,
               limits: Limits = Limits(), allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """An app serving `engine`. Its lifespan starts the engine loop and, at shutdown, drains it for up to
    `drain_timeout` seconds (uvicorn has already waited for open connections by then). The caller owns `engine`
    (and shuts it down), but must not call it while the app runs: the engine loop's thread is then its only user.
    Pass the EngineThread the engine was built on, so the loop runs there (engine_loop.py says why).
    `allowed_hosts`: refuse requests a web page could send (browser.py; `browser.allowed_hosts` says when)."""
    fe = Frontend(engine, served_model_name or engine.path.name, api_key, max_queue, thread, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(fe.loop.shutdown, drain_timeout)
            fe.text_thread.shutdown(wait=False, cancel_futures=True)
            fe.chat_tools.close()
            await asyncio.to_thread(fe.renderer.close)

    app = FastAPI(title="llmq", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # served below, behind the key
    app.state.frontend = fe
    if allowed_hosts is not None:
        app.add_middleware(BrowserGuard, allowed=allowed_hosts)

    def openapi() -> dict:
        """FastAPI's schema plus the request bodies, which the handlers parse themselves (parsing.read_body)."""
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
        msg, param = validation_message(e.errors())
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

    add_page(app, fe, auth)

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

    @app.post("/v1/completions", dependencies=[Depends(auth)], openapi_extra=body_doc(CompletionRequest))
    async def completions(request: Request):
        body = await read_body(CompletionRequest, request, fe.limits.max_body_bytes)
        fe.check_model(body.model)
        for field, bad in (("suffix", body.suffix is not None), ("best_of", body.best_of not in (None, 1)),
                           ("echo", body.echo and body.stream),
                           ("prompt_logprobs", body.prompt_logprobs is not None and body.stream)):
            if bad:
                raise bad_request(f"{field} is not supported" + (" with stream" if body.stream else ""), field)
        if body.max_tokens == 0 and not (body.echo or body.prompt_logprobs is not None):
            raise bad_request("max_tokens: 0 asks for the prompt alone: give echo or prompt_logprobs", "max_tokens")
        n_lp = fe.check_logprobs(body.logprobs, "logprobs")
        n_plp = fe.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        p = body.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise bad_request("one prompt per request (batch the requests instead)", "prompt")
            p = p[0]
        if isinstance(p, str):
            fe.check_chars(len(p), "prompt")
            ids = fe.check_ids(list(await fe.off_loop(fe.tokenizer.encode, p)))
        else:
            ids = fe.check_ids(list(p))
            if body.echo:
                p = await fe.off_loop(fe.tokenizer.decode, ids)
        # echo with logprobs N scores the prompt's tokens as the generated ones: the engine's prompt_logprobs, the
        # top N or K of both asked
        wants = [k for k in (n_plp, n_lp if body.echo else None) if k is not None]
        params = fe.params(body, len(ids), body.max_tokens, 16, n_lp, max(wants) if wants else None,
                           prompt_param="prompt_logprobs" if n_plp is not None else "logprobs")
        rid = f"cmpl-{uuid.uuid4().hex}"
        as_ids = body.return_tokens_as_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text: str, out: RequestOutput, offset: int, final: bool) -> dict:
            lp = None
            if n_lp is not None and out.new_logprobs:
                lp = fe.completion_logprobs(out.new_logprobs, out.new_token_ids, offset, as_ids, n_lp)
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp,
                                 "finish_reason": out.finish_reason if final else None}]}

        def full(out: RequestOutput, lps: list, toks: list[int], prompt: PromptLogprobs | None) -> dict:
            """The whole answer; with echo the prompt's text and tokens first (OpenAI's legacy semantics)."""
            if body.echo:
                lps, toks = ([None, *prompt.entries] if n_lp is not None else []) + lps, ids + toks
            choice = {"index": 0, "text": p + out.text if body.echo else out.text, "finish_reason": out.finish_reason,
                      "logprobs": None if n_lp is None else fe.completion_logprobs(lps, toks, 0, as_ids, n_lp)}
            if n_plp is not None:
                choice["prompt_logprobs"] = fe.prompt_logprobs(ids, prompt, n_plp)
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.name,
                    "choices": [choice], "usage": usage(out)}

        return await respond(fe, request, rid, ids, params, body.stream, include_usage, chunk, None, full)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], openapi_extra=body_doc(ChatCompletionRequest))
    async def chat(request: Request):
        body = await read_body(ChatCompletionRequest, request, fe.limits.max_body_bytes)
        fe.check_model(body.model)
        for field, bad in (("echo", body.echo), ("prompt_logprobs", body.prompt_logprobs is not None)):
            if bad:
                raise bad_request(f"{field} is supported on /v1/completions only", field)
        if not getattr(fe.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        if len(body.messages) > fe.max_model_len:  # every template spends a token or more on each message
            raise bad_request(f"This model's maximum context length is {fe.max_model_len} tokens; the request has "
                              f"{len(body.messages)} messages.", "messages", "context_length_exceeded")
        messages = [m.template_dict() for m in body.messages]
        fe.check_chars(sum(len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)
                           for c in (m["content"] for m in messages)), "messages")
        urls = [u for m in body.messages for u in m.image_urls()]
        pixels = None
        tp = plan_tools(fe.chat_tools, body, fe.limits.max_schema_bytes)
        grammar = await prepare_tools(fe.chat_tools, tp, fe.renderer, fe.off_loop, fe.limits.grammar_timeout)
        in_reasoning = False

        def template() -> list[int]:
            nonlocal pixels, in_reasoning
            images = fe.read_images(urls) if urls else []
            try:
                kind, text = fe.renderer.render(messages, add_generation_prompt=True,
                                                **({"tools": tp.tools} if tp.tools else {}))
            except TemplateError as e:  # past its deadline or memory
                raise bad_request(str(e), "messages") from None
            if kind != "ok":  # one that rejects these messages (e.g. roles out of order), or a hostile one
                raise bad_request(f"the chat template rejected the messages: {text}" if kind == "rejected" else text,
                                  "messages")
            in_reasoning = fe.chat_tools.format.opens_reasoning(text)
            if fe.images is None:
                return fe.tokenizer.encode(text, add_special_tokens=False)
            try:   # the model's processor places each image's tokens (runtime.images)
                ids, pixels = fe.images(text, images)
            except LlmqError as e:
                raise bad_request(str(e), "messages") from None
            return ids

        ids = fe.check_ids(await fe.off_loop(template))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n_top = (fe.check_logprobs(body.top_logprobs, "top_logprobs") or 0) if body.logprobs else None
        params = fe.params(body, len(ids), max_tokens, None, n_top, logprobs_param="top_logprobs")
        # a grammar, and the format's markers kept as text where they are special tokens (to read the answer)
        params = replace(params, grammar=grammar,
                         skip_special_tokens=params.skip_special_tokens and not fe.chat_tools.special)
        answer = ChatAnswer(fe.chat_tools.format, in_reasoning, tp.parse_tools)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        as_ids = body.return_tokens_as_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def base() -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": fe.name}

        def chunk(text: str, out: RequestOutput, offset: int, final: bool) -> dict:
            lp = None
            if n_top is not None and out.new_logprobs:
                lp = fe.chat_logprobs(out.new_logprobs, out.new_token_ids, n_top, as_ids)
            return dict(base(), choices=[{"index": 0, "delta": answer.delta(text, final), "logprobs": lp,
                                          "finish_reason": answer.finish_reason(out.finish_reason) if final else None}])

        first = dict(base(), choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}])
        def full(out: RequestOutput, lps: list, toks: list[int], prompt: PromptLogprobs | None) -> dict:
            lp = None if n_top is None else fe.chat_logprobs(lps, toks, n_top, as_ids)
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": fe.name,
                    "choices": [{"index": 0, "message": answer.message(out.text),
                                 "finish_reason": answer.finish_reason(out.finish_reason), "logprobs": lp}],
                    "usage": usage(out)}

        return await respond(fe, request, rid, ids, params, body.stream, include_usage, chunk, first, full, pixels)

    return app
