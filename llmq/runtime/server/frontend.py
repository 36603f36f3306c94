"""The per-app state of the HTTP front end (the engine loop, the handlers' tokenizer, limits) and what the handlers
ask of it: checks that turn a bad request into a 400 before it costs the engine anything, SamplingParams from a
body, submission with 429 / 503 for a full or closed queue, and OpenAI's logprob shapes."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...errors import LlmqError
from ...models.chat import RenderWorker
from ...models.vision import runs_images
from ..config import Limits
from ..engine import LLMEngine
from ..images import ImageLimits, ImagePrompt, data_url_bytes, decode_image
from ..sampling import PromptLogprobs, SamplingParams
from .engine_loop import EngineLoop, EngineThread, NotAccepting, QueueFull
from .metrics import ServerMetrics
from .protocol import APIError, SamplingFields, bad_request
from .tools import ChatTools


def artifact_ref(path: Path) -> str | None:
    """`name/vN` of an artifact directory (`<store>/<name>/v<N>/llmq.json`): what /v1/models reports as `root`, so a
    client with the same store finds the model (and its tokenizer) without the server showing its filesystem."""
    if (path / "llmq.json").is_file() and path.name[1:].isdigit() and path.name.startswith("v"):
        return f"{path.parent.name}/{path.name}"
    return None


class Frontend:
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
        self.renderer = RenderWorker(self.tokenizer, self.max_prompt_chars)  # chat templates, bounded
        self.chat_tools = ChatTools(self.tokenizer, self.vocab_size, engine.eos_token_ids)  # tools, grammars
        self.waiting: set[asyncio.Queue] = set()  # the output queues of the requests being answered
        self.owing: dict[str, int] = {}  # per request in flight, the log-probabilities its answer may hold
        self.owed_in_flight = 0
        # a vision-language model's processor (image_url parts), else None: images are refused
        self.images = ImagePrompt(engine.path) if runs_images(engine.spec.vision) else None
        self.image_limits = ImageLimits()

    def read_images(self, urls: list[str]) -> list:
        """The request's images decoded within ImageLimits; a 400 in one line for anything refused."""
        if self.images is None:
            raise bad_request(f"this model ({self.engine.spec.architecture}) is text-only: image_url parts are "
                              "refused", "messages")
        lim = self.image_limits
        if len(urls) > lim.max_images:
            raise bad_request(f"{len(urls)} images; at most {lim.max_images} a request", "messages")
        try:
            return [decode_image(*data_url_bytes(u, lim), lim) for u in urls]
        except LlmqError as e:
            raise bad_request(str(e), "messages") from None

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
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the {param} has "
                              f"{n} characters, more than that many tokens hold.", param, "context_length_exceeded")

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:  # first: the range check below reads every id
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                              f"{len(ids)} tokens.", "prompt", "context_length_exceeded")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return ids

    def check_logprobs(self, n: int | None, param: str) -> int | None:
        """A log-probability count within --max-logprobs, -1 (the whole vocabulary) resolved; else a 400."""
        cap = self.limits.max_logprobs
        if n is None or (n != -1 and n <= cap) or cap == -1:
            return self.vocab_size if n == -1 else n
        asked = "the whole vocabulary (-1)" if n == -1 else f"{n} log-probabilities per position"
        bound = "--max-logprobs -1" if n == -1 else f"at most {cap} (--max-logprobs)"
        raise bad_request(f"{param}: {asked} asked for; this server gives {bound}", param)

    def params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None, prompt_logprobs: int | None = None, logprobs_param: str = "logprobs",
               prompt_param: str = "prompt_logprobs") -> SamplingParams:
        """The request's SamplingParams; a 400 for anything out of bounds, an answer of more log-probabilities than
        --max-logprob-entries included (named by `logprobs_param` / `prompt_param`)."""
        if body.n != 1:
            raise bad_request("only n=1 is supported", "n")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        lim = self.limits
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > lim.max_stop_strings or any(len(x) > lim.max_stop_chars for x in stop):
            raise bad_request(f"at most {lim.max_stop_strings} stop strings of at most {lim.max_stop_chars} characters",
                              "stop")
        if len(body.stop_token_ids or []) > lim.max_stop_strings:
            raise bad_request(f"at most {lim.max_stop_strings} stop_token_ids", "stop_token_ids")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                              "for the completion).", "max_tokens", "context_length_exceeded")
        try:
            temperature = 1.0 if body.temperature is None else body.temperature
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                    top_k=-1 if body.top_k in (None, 0) else body.top_k,
                                    top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=stop,
                                    stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                                    skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs)
        except LlmqError as e:
            raise bad_request(str(e)) from None
        prompt, generated = self.owed(params, prompt_len)
        if prompt + generated > lim.max_logprob_entries:
            param, k = (prompt_param, params.prompt_logprobs) if prompt >= generated else (logprobs_param,
                                                                                           params.logprobs)
            raise bad_request(f"{param}: the answer would hold {prompt + generated:,} log-probabilities "
                              f"({min(k, self.vocab_size) + 1:,} a position); this server answers at most "
                              f"{lim.max_logprob_entries:,} (--max-logprob-entries)", param)
        return params

    def owed(self, params: SamplingParams, prompt_len: int) -> tuple[int, int]:
        """The most log-probabilities a request's answer holds, (the prompt's, the generated tokens'): per position
        its top N and its own token."""
        per = [0 if k is None else min(k, self.vocab_size) + 1 for k in (params.prompt_logprobs, params.logprobs)]
        return (prompt_len - 1) * per[0], params.max_tokens * per[1]

    def submit(self, rid: str, ids: list[int], params: SamplingParams, view=None, images=None) -> asyncio.Queue:
        """Queue a request (429 past --max-logprob-entries-in-flight); call `settle(rid)` once it is answered.
        images: its pixel values (LLMEngine.add_request's)."""
        owed = sum(self.owed(params, len(ids)))
        if owed and self.owed_in_flight + owed > self.limits.max_logprob_entries_in_flight:
            self.metrics.rejected("logprobs_in_flight")
            raise APIError(429, f"the requests in flight hold {self.owed_in_flight:,} log-probabilities and this one "
                           f"{owed:,}; this server holds at most {self.limits.max_logprob_entries_in_flight:,} "
                           "(--max-logprob-entries-in-flight); retry later", "rate_limit_exceeded",
                           code="logprobs_in_flight", headers={"Retry-After": "1"})
        try:
            q = self.loop.submit(rid, ids, params, asyncio.get_running_loop(), view, images)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise APIError(429, f"{e}; retry later", "rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotAccepting as e:
            self.metrics.rejected("unavailable")
            raise APIError(503, str(e), "service_unavailable", code="unavailable") from None
        self.owing[rid] = owed
        self.owed_in_flight += owed
        return q

    def settle(self, rid: str) -> int:
        """A request is answered: its log-probabilities leave the in-flight count (returned)."""
        owed = self.owing.pop(rid, 0)
        self.owed_in_flight -= owed
        return owed

    # -- response pieces ---------------------------------------------------------------------------------------------
    def completion_logprobs(self, lps: list[dict[int, float] | None], tokens: list[int], offset: int, as_ids: bool,
                            n: int) -> dict:
        """OpenAI's legacy logprobs over `tokens`, each with its {token: logprob} entry (None: the echoed prompt's
        first token, which has no distribution before it): that token's logprob and, as vLLM, the top n plus it."""
        name = (lambda t: f"token_id:{t}") if as_ids else self.token_text
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(self.token_text(t))
        tops = [None if lp is None else {name(k): v for k, v in _top(lp, n)} | {name(t): lp[t]}
                for lp, t in zip(lps, tokens)]
        return {"tokens": [name(t) for t in tokens],
                "token_logprobs": [None if lp is None else lp[t] for lp, t in zip(lps, tokens)],
                "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs(self, ids: list[int], plp: PromptLogprobs, n: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank, decoded_token}} of
        that token (its rank in the vocabulary) and of the top n (ranks 1..n)."""
        def entry(v: float, rank: int, t: int) -> dict:
            return {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)}

        out: list[dict | None] = [None]
        for t, lp, rank in zip(ids[1:], plp.entries, plp.ranks):
            d = {t: entry(lp[t], rank, t)}
            for r, (k, v) in enumerate(_top(lp, n), 1):
                d.setdefault(k, entry(v, r, k))
            out.append(d)
        return out

    def chat_logprobs(self, lps: list[dict[int, float]], tokens: list[int], n: int, as_ids: bool) -> dict:
        def entry(t, v):
            s = self.token_text(t)
            return {"token": f"token_id:{t}" if as_ids else s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [dict(entry(t, lp[t]), top_logprobs=[entry(k, v) for k, v in _top(lp, n)])
                            for lp, t in zip(lps, tokens)]}


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])[:n]
