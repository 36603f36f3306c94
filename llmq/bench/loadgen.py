"""The load generator: streams requests at any OpenAI-compatible endpoint and timestamps every chunk.

Two loops, both bounded by a request count and a time limit: closed loop (N concurrent clients, each sending its
next request when the last one finished) and open loop (Poisson arrivals at a given rate, seeded, independent of
how fast the server answers). Requests still running when the time limit hits are cancelled and marked so.
Token counts come from the server's `usage` (requested with stream_options.include_usage); a server that sends
none gets its counts estimated (by tokenizing the output when a tokenizer is known, else one token per chunk).

Every request to an endpoint, here and in `llmq eval --endpoint` / `deploy verify`, is bounded as a whole: its answer
must be complete within a deadline (a bound per read never ends a server that drips its answer or streams forever)
and within answer_limit bytes of what was asked, read as it arrives (an endless or huge body is refused, not held).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..artifacts.secrets import redact
from ..errors import LlmqError
from .prompts import Prompt
from .stats import RequestRecord


@dataclass
class Endpoint:
    base: str  # scheme://host:port[/prefix], without the trailing /v1
    model: str
    root: str | None = None  # what /v1/models says the model was loaded from (a path for llmq and vLLM)
    api_key: str | None = None
    max_model_len: int | None = None  # the context /v1/models reports (llmq and vLLM do)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


ANSWER_BYTES = 8 << 20  # what any answer may hold, beyond ITEM_BYTES for each token or logprob entry asked for
ITEM_BYTES = 512  # a streamed chunk, or a JSON logprob entry with its decoded token, generously


def answer_limit(items: int = 0) -> int:
    """The most bytes an answer holding `items` tokens or logprob entries may take."""
    return ANSWER_BYTES + ITEM_BYTES * items


async def body_chunks(resp, limit: int):
    """`resp`'s body as it arrives; a one-line LlmqError once it passes `limit` bytes (or declares more)."""
    big = f"{resp.request.url}: the answer is larger than {limit / 2**20:.4g} MiB"
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise LlmqError(big)
    got = 0
    async for chunk in resp.aiter_bytes():
        got += len(chunk)
        if got > limit:
            raise LlmqError(big)
        yield chunk


async def read_body(resp, limit: int) -> bytes:
    """`resp`'s whole body, at most `limit` bytes (body_chunks)."""
    return b"".join([c async for c in body_chunks(resp, limit)])


async def fetch(client, method: str, url: str, deadline: float, limit: int, **kw) -> tuple[int, bytes]:
    """(status, body) of one request, all of it within `deadline` seconds and `limit` bytes; a one-line LlmqError
    for a transport failure or either bound."""
    import httpx

    async def whole():
        async with client.stream(method, url, **kw) as resp:
            return resp.status_code, await read_body(resp, limit)

    try:
        return await asyncio.wait_for(whole(), deadline)
    except asyncio.TimeoutError:
        raise LlmqError(f"{url}: no complete answer within {deadline:g} s") from None
    except httpx.HTTPError as e:
        raise LlmqError(f"cannot reach {url}: {type(e).__name__}: {e or 'no answer'}") from None


async def probe(url: str, model: str | None, api_key: str | None = None, timeout: float = 10.0) -> Endpoint:
    """Check that `url` serves the OpenAI API (GET /v1/models) and `model`; a clear LlmqError before any load."""
    import httpx

    base = normalize_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        status, content = await fetch(client, "GET", base + "/v1/models", timeout, answer_limit(), headers=headers)
    if status in (401, 403):
        raise LlmqError(f"{base} refused the request (HTTP {status}); give the key with --api-key")
    if status != 200:
        raise LlmqError(f"{base}/v1/models answered HTTP {status}; is this an OpenAI-compatible endpoint?")
    try:
        data = json.loads(content)["data"]
        served = {m["id"]: m for m in data}
    except (ValueError, KeyError, TypeError):
        raise LlmqError(f"{base}/v1/models did not return an OpenAI model list; is this an OpenAI-compatible "
                        "endpoint?") from None
    if not served:
        raise LlmqError(f"{base} serves no models")
    if model is None:
        if len(served) > 1:
            raise LlmqError(f"{base} serves {len(served)} models ({', '.join(served)}); pick one with --model")
        model = next(iter(served))
    elif model not in served:
        raise LlmqError(f"{base} does not serve model {model!r}; it serves: {', '.join(served)}")
    root, max_len = served[model].get("root"), served[model].get("max_model_len")
    return Endpoint(base, model, root if isinstance(root, str) else None, api_key,
                    max_len if isinstance(max_len, int) and max_len > 0 else None)


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (else the body's start), on one line and without secrets: the one
    way a server's words reach an error line or a report."""
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        text = str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        text = body[:4096].decode(errors="replace")
    return redact(" ".join(text.split()))[:200]


class LoadGenerator:
    def __init__(self, endpoint: Endpoint, api: str = "completions", temperature: float = 0.0,
                 ignore_eos: bool = True, tokenizer=None, warn: Callable[[str], None] | None = None,
                 request_timeout: float = 600.0):
        if api not in ("completions", "chat"):
            raise LlmqError(f"api must be completions or chat, got {api!r}")
        self.endpoint = endpoint
        self.api = api
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.tokenizer = tokenizer
        self.request_timeout = request_timeout
        self._warn = warn or (lambda msg: None)
        self._warned = False

    def _request(self, prompt: Prompt) -> tuple[str, dict]:
        body = {"model": self.endpoint.model, "max_tokens": prompt.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
            return self.endpoint.base + "/v1/chat/completions", body
        body["prompt"] = prompt.text
        return self.endpoint.base + "/v1/completions", body

    def _content(self, chunk: dict) -> str:
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        c = choices[0]
        if self.api == "chat":
            return (c.get("delta") or {}).get("content") or ""
        return c.get("text") or ""

    def _estimate(self, rec: RequestRecord, prompt: Prompt, text: str) -> None:
        if not self._warned:
            self._warned = True
            how = "tokenizing the output" if self.tokenizer is not None else "counting streamed chunks"
            self._warn(f"the server reported no token usage; estimating token counts by {how}")
        rec.tokens_estimated = True
        if self.tokenizer is not None:
            rec.completion_tokens = len(self.tokenizer.encode(text, add_special_tokens=False))
            rec.prompt_tokens = len(self.tokenizer.encode(prompt.text))
        else:
            rec.completion_tokens = len(rec.chunk_times)
            rec.prompt_tokens = prompt.input_len

    async def send(self, client, index: int, prompt: Prompt, t0: float, records: list[RequestRecord]) -> None:
        """One streamed request, whole within request_timeout seconds and answer_limit(max_tokens) bytes; its record
        is appended first, so a cancelled request is still accounted for."""
        import httpx

        url, body = self._request(prompt)
        rec = RequestRecord(index=index, start=time.perf_counter() - t0)
        records.append(rec)
        parts: list[str] = []
        try:
            usage = await asyncio.wait_for(self._stream(client, url, body, rec, t0, parts), self.request_timeout)
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        except asyncio.TimeoutError:
            rec.error = f"no complete answer within {self.request_timeout:g} s"
        except LlmqError as e:  # an error status, or an answer past its size
            rec.error = str(e)
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            rec.end = time.perf_counter() - t0
            if rec.error is None and rec.ttft is None:
                rec.error = "the response carried no output text"
            if usage and usage.get("completion_tokens") is not None:
                rec.completion_tokens = int(usage["completion_tokens"])
                rec.prompt_tokens = usage.get("prompt_tokens")
            else:
                self._estimate(rec, prompt, "".join(parts))
            return
        rec.end = time.perf_counter() - t0

    async def _stream(self, client, url: str, body: dict, rec: RequestRecord, t0: float, parts: list[str]
                      ) -> dict | None:
        """Read one answer's events into `rec` (chunk times, an error) and `parts` (its text); its usage, if sent."""
        usage = None
        limit = answer_limit(body["max_tokens"])
        async with client.stream("POST", url, json=body, headers=self.endpoint.headers) as resp:
            if resp.status_code != 200:
                raise LlmqError(f"HTTP {resp.status_code}: {error_message(await read_body(resp, limit))}")
            async for line in _lines(body_chunks(resp, limit)):
                now = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"unexpected stream event {error_message(data.encode())[:80]!r}")
                if "error" in chunk:
                    rec.error = f"in-stream error: {error_message(data.encode())}"
                    break
                text = self._content(chunk)
                if text:
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    rec.chunk_times.append(now)
                    parts.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        return usage

    def _client(self, connections: int):
        import httpx

        return httpx.AsyncClient(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=
                                                     connections), timeout=self.request_timeout)

    @staticmethod
    async def _finish(tasks: list[asyncio.Task], deadline: float) -> None:
        """Wait for the tasks until the deadline, then cancel what is left and let it record the cancellation."""
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.perf_counter(), 0))
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def closed_loop(self, prompts: list[Prompt], concurrency: int, time_limit: float) -> list[RequestRecord]:
        """`concurrency` clients, each sending its next prompt as soon as its last answer ended."""
        if concurrency < 1:
            raise LlmqError(f"concurrency must be >= 1, got {concurrency}")
        records: list[RequestRecord] = []
        queue = list(enumerate(prompts))[::-1]
        async with self._client(concurrency) as client:
            t0 = time.perf_counter()
            deadline = t0 + time_limit
            async def worker():
                while queue and time.perf_counter() < deadline:
                    i, p = queue.pop()
                    await self.send(client, i, p, t0, records)

            await self._finish([asyncio.create_task(worker()) for _ in range(concurrency)], deadline)
        return sorted(records, key=lambda r: r.index)

    async def open_loop(self, prompts: list[Prompt], rate: float, time_limit: float, seed: int = 0,
                        max_connections: int = 1024) -> list[RequestRecord]:
        """Poisson arrivals at `rate` requests/s (inf: all at once), whatever the server's speed."""
        if not rate > 0:
            raise LlmqError(f"request rate must be > 0, got {rate}")
        offsets = poisson_arrivals(len(prompts), rate, seed)
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task] = []
        async with self._client(max_connections) as client:
            t0 = time.perf_counter()
            deadline = t0 + time_limit
            for (i, p), at in zip(enumerate(prompts), offsets):
                wait = t0 + at - time.perf_counter()
                if t0 + at >= deadline:
                    break
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(self.send(client, i, p, t0, records)))
            await self._finish(tasks, deadline)
        return sorted(records, key=lambda r: r.index)


async def _lines(chunks):
    """The lines of a body arriving in `chunks` (bytes), decoded; a line's end is LF or CRLF."""
    rest = b""
    async for chunk in chunks:
        *done, rest = (rest + chunk).split(b"\n")
        for line in done:
            yield line.rstrip(b"\r").decode(errors="replace")
    if rest:
        yield rest.decode(errors="replace")


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
