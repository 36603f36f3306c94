"""The load generator: streams requests at any OpenAI-compatible endpoint and timestamps every chunk.

Two loops, both bounded by a request count and a time limit: closed loop (N concurrent clients, each sending its
next request when the last one finished) and open loop (Poisson arrivals at a given rate, seeded, independent of
how fast the server answers). Requests still running when the time limit hits are cancelled and marked so.
Token counts come from the server's `usage` (requested with stream_options.include_usage); a server that sends
none gets its counts estimated (by tokenizing the output when a tokenizer is known, else one token per chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

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


async def probe(url: str, model: str | None, api_key: str | None = None, timeout: float = 10.0) -> Endpoint:
    """Check that `url` serves the OpenAI API (GET /v1/models) and `model`; a clear LlmqError before any load."""
    import httpx

    base = normalize_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(base + "/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise LlmqError(f"cannot reach {base}: {type(e).__name__}: {e or 'no answer'}") from None
    if resp.status_code in (401, 403):
        raise LlmqError(f"{base} refused the request (HTTP {resp.status_code}); give the key with --api-key")
    if resp.status_code != 200:
        raise LlmqError(f"{base}/v1/models answered HTTP {resp.status_code}; is this an OpenAI-compatible endpoint?")
    try:
        data = resp.json()["data"]
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
    """The message of an OpenAI-style error body (else the body's start), for a one-line error."""
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    except ValueError:
        return body.decode(errors="replace")[:200]


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
        """One streamed request; its record is appended first, so a cancelled request is still accounted for."""
        import httpx

        url, body = self._request(prompt)
        rec = RequestRecord(index=index, start=time.perf_counter() - t0)
        records.append(rec)
        parts: list[str] = []
        usage = None
        try:
            async with client.stream("POST", url, json=body, headers=self.endpoint.headers,
                                     timeout=self.request_timeout) as resp:
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {error_message(await resp.aread())}"
                    rec.end = time.perf_counter() - t0
                    return
                async for line in resp.aiter_lines():
                    now = time.perf_counter() - t0
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"unexpected stream event {data[:80]!r}")
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
            rec.end = time.perf_counter() - t0
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {str(e)[:200]}"
            rec.end = time.perf_counter() - t0
            return
        if rec.error is None and rec.ttft is None:
            rec.error = "the response carried no output text"
        if usage and usage.get("completion_tokens") is not None:
            rec.completion_tokens = int(usage["completion_tokens"])
            rec.prompt_tokens = usage.get("prompt_tokens")
        else:
            self._estimate(rec, prompt, "".join(parts))

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


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
