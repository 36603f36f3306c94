"""An OpenAI-compatible server as lm-eval's `LM` (`llmq eval --endpoint URL`): the deployed model, not our runtime.

Generation sends the token ids the in-process backends feed (same truncation, max tokens, stop strings, greedy
sampling, per-request seeds) to /v1/completions, so a server running the same model answers the same text. Scoring
and KL divergence read the logprobs the server returns, in the first of these shapes it accepts (`PROMPT_SHAPES`):
- `prompt_logprobs`: vLLM's extension, log p of every prompt token and the top k in one request;
- `echo`: the OpenAI legacy `echo` + `logprobs` (with vLLM's `return_tokens_as_token_ids`, so tokens come as ids);
- `logprobs`: next-token logprobs only (`logprobs` + `return_tokens_as_token_ids`): one request per position, its
  top k;
- `n_probs`: llama-server's native /completion with `n_probs` (it refuses `echo`): likewise, one request a position.
The first two score given text exactly (loglikelihood tasks). llama-server does too, a token a request: a `logit_bias`
forces the scored token to be the one generated, and the logprob it reports for the generated token comes from the
raw logits, before the sampler's bias (tools/server's populate_token_probs); the `logprobs` shape cannot, and its
scoring tasks are refused.
Servers cap k (at 20 by default), so KL divergence is the top-k form (kld.topk_token_kl), unless a prompt shape
answers k = -1 with the whole vocabulary (vLLM's and `llmq serve`'s `--max-logprobs -1`): then it is exact.
"""

from __future__ import annotations

import asyncio
import json
import math

import torch

from ..bench.loadgen import Endpoint, answer_limit, error_message, fetch
from ..errors import LlmqError
from ..runtime import ScoreRequest
from .lm import DEFAULT_MAX_LENGTH, EvalLM, Generation, ProgressFn, Score

TOP_K = 20  # the most OpenAI's API, vLLM's default max_logprobs and `llmq serve` return
PROMPT_SHAPES = ("prompt_logprobs", "echo")  # shapes that give the logprobs of given tokens
FORCE_BIAS = 1e4  # a logit bias no other token's logit can beat: the token generated is the one scored
MASS_SLACK = 1e-3  # the rounding a server's logprobs may carry: probabilities summing past 1 + this are impossible
CONCURRENCY = 8


class EndpointLM(EvalLM):
    """lm-eval's LM over an endpoint; `shape`: the first logprobs shape it answered (None: none); `top_k`: how many
    logprobs a position gives, None where the server gives whole distributions."""

    top_k: int | None = TOP_K
    declined: str | None = None  # the last error status the server answered, for a refusal's line

    def __init__(self, ep: Endpoint, tokenizer, seed: int = 0, progress: ProgressFn | None = None,
                 max_length: int = DEFAULT_MAX_LENGTH, timeout: float = 60.0):
        # one token short of the server's context: a request for prompt logprobs still generates a token
        super().__init__(tokenizer, min(max_length, (ep.max_model_len or max_length + 1) - 1), seed, progress)
        self.ep, self.timeout = ep, timeout
        self.shape = self._detect()  # None: the server returns no token-id logprobs
        if self.shape in PROMPT_SHAPES and self._whole_vocabulary():
            self.top_k = None

    # -- HTTP --------------------------------------------------------------------------------------------------------
    async def _post(self, client, path: str, body: dict, strict: bool = True) -> dict | None:
        """The JSON answer, whole within --timeout and its size bound (loadgen.fetch); a one-line LlmqError for a
        transport failure, either bound, a non-JSON answer, or (strict) an error status; None for an error status
        when not strict: a capability the server lacks (llama-server answers `echo` with a 500)."""
        url = self.ep.base + path
        status, content = await fetch(client, "POST", url, self.timeout, self._limit(body), json=body,
                                      headers=self.ep.headers)
        if status != 200:
            self.declined = f"HTTP {status}: {error_message(content)}"
            if strict:
                raise LlmqError(f"{url} answered {self.declined}")
            return None
        try:
            data = json.loads(content)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise LlmqError(f"{url} did not answer a JSON object; is this an OpenAI-compatible endpoint?")
        return data

    def _limit(self, body: dict) -> int:
        """The size bound of an answer to `body`: a logprob entry for each of its top k (or, k = -1, the vocabulary)
        at each prompt and generated token (a chat request's answer holds only the generated ones)."""
        ks = [body.get(key) for key in ("prompt_logprobs", "logprobs", "n_probs")]
        per = len(self.tokenizer) if -1 in ks else max(k or 0 for k in ks) + 1
        return answer_limit((len(body.get("prompt", ())) + body.get("max_tokens", body.get("n_predict", 0))) * per)

    def _post_all(self, path: str, bodies: list[dict], progress: bool = True, strict: bool = True
                  ) -> list[dict | None]:
        """Every body, CONCURRENCY at a time, answers in order (see _post for `strict`)."""
        import httpx

        async def run():
            gate = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0))) as c:
                async def one(body):
                    async with gate:
                        out = await self._post(c, path, body, strict)
                    if progress:
                        self.progress(0, 1)
                    return out

                return await asyncio.gather(*map(one, bodies))

        return asyncio.run(run())

    # -- what the server gives ---------------------------------------------------------------------------------------
    def _body(self, shape: str, tokens: list[int], k: int) -> tuple[str, dict]:
        """The request for `shape` over prompt `tokens`, asking for the top k."""
        if shape == "n_probs":  # llama-server's own API; temperature < 0: greedy, probabilities from a plain softmax
            return "/completion", {"prompt": tokens, "n_predict": 1, "n_probs": k, "temperature": -1,
                                   "cache_prompt": True}
        body = {"model": self.ep.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        if shape == "prompt_logprobs":
            body["prompt_logprobs"] = k
        else:
            body.update(logprobs=k, return_tokens_as_token_ids=True, echo=shape == "echo")
        return "/v1/completions", body

    def _parse(self, shape: str, data: dict, tokens: list[int]) -> list[dict[int, float]] | None:
        """{token id: logprob} per position: for a prompt shape, the distributions before tokens[1:], each with that
        token's own entry; else the one distribution after the prompt. None when the answer lacks that shape."""
        n = len(tokens)
        try:
            if shape == "n_probs":
                top = data["completion_probabilities"][0]["top_logprobs"]  # [{"id", "token", "logprob", ...}]
                return [{int(e["id"]): float(e["logprob"]) for e in top}]
            choice = data["choices"][0]
            if shape == "prompt_logprobs":  # [None, {"<id>": {"logprob": x, "rank": r, "decoded_token": s}}, ...]
                lps = choice["prompt_logprobs"]
                if not isinstance(lps, list) or len(lps) < n:
                    return None
                return [{int(t): float(v["logprob"] if isinstance(v, dict) else v) for t, v in e.items()}
                        for e in lps[1:n]]
            lp = choice["logprobs"]
            if shape == "echo":  # the prompt's tokens first: token_logprobs [None, x1, ...], top_logprobs alike
                if len(lp["top_logprobs"]) < n or len(lp["token_logprobs"]) < n:
                    return None
                return [{**{_token_id(t): float(v) for t, v in lp["top_logprobs"][j].items()},
                         tokens[j]: float(lp["token_logprobs"][j])} for j in range(1, n)]
            return [{_token_id(t): float(v) for t, v in lp["top_logprobs"][0].items()}]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            return None

    def _detect(self) -> str | None:
        probe = [self.prefix_token_id] + self.encode("1 + 1 = 2")[:3]
        for shape in ("prompt_logprobs", "echo", "logprobs", "n_probs"):
            path, body = self._body(shape, probe, 1)
            data = self._post_all(path, [body], progress=False, strict=False)[0]
            if data is not None and self._parse(shape, data, probe):
                return shape
        return None

    def _whole_vocabulary(self) -> bool:
        """Whether the server answers k = -1 with every token of the vocabulary at every position of a prompt as long
        as a KLD window: a server bounding positions x vocabulary (`llmq serve --max-logprob-entries`) may give a
        short prompt's and refuse a window's, and then only top-k KLD is possible."""
        from .kld import WINDOW

        text = self.encode("1 + 1 = 2. " * WINDOW)
        probe = ([self.prefix_token_id] + text)[:min(WINDOW, self.max_length)]
        path, body = self._body(self.shape, probe, -1)
        data = self._post_all(path, [body], progress=False, strict=False)[0]
        rows = None if data is None else self._parse(self.shape, data, probe)
        return bool(rows) and all(len(r) >= len(self.tokenizer) for r in rows)

    @property
    def scores_prompts(self) -> bool:
        """Whether the server gives the logprobs of given tokens (loglikelihood tasks need them)."""
        return self.shape in PROMPT_SHAPES or self.shape == "n_probs"

    def refusal(self, what: str) -> str:
        got = {None: "returns no logprobs named by token id",
               "logprobs": "returns next-token logprobs only"}.get(self.shape, self.shape)
        return (f"{what} refused: {self.ep.base} {got} (tried vLLM's prompt_logprobs, echo + logprobs, logprobs with "
                "return_tokens_as_token_ids, llama-server's n_probs" +
                (f"; its last error answer: {self.declined})" if self.declined else ")"))

    def _prompts(self, prompts: list[list[int]], k: int, progress: bool = False) -> list[list[dict[int, float]]]:
        """For a prompt shape, one request a prompt: {token id: logprob} of the distribution before each of its tokens
        after the first (its top k and that token's own entry)."""
        reqs = [self._body(self.shape, ids, k) for ids in prompts]
        answers = self._post_all(reqs[0][0], [b for _, b in reqs], progress) if reqs else []
        return [self._checked(self._parse(self.shape, a, ids), len(ids) - 1) for a, ids in zip(answers, prompts)]

    def _checked(self, out: list | None, n: int) -> list[dict[int, float]]:
        if out is None or len(out) != n or not all(out):
            raise LlmqError(f"{self.ep.base} answered logprobs in an unexpected shape ({self.shape})")
        for row in out:
            self._possible(row.values())
        return out

    def _possible(self, logprobs) -> None:
        """Refuse, in one line, the logprobs of one position no distribution has: one above 0, probabilities
        summing past 1, NaN (beyond MASS_SLACK of rounding). Taken as given they would pass any gate: a logprob of
        1e308 everywhere makes every KL divergence 0."""
        lps = list(logprobs)
        worst = max(lps)  # NaN when it comes first; a NaN after it makes the mass NaN
        if not worst <= math.log1p(MASS_SLACK):
            raise LlmqError(f"{self.ep.base} answered a logprob of {worst:g}, which no probability has; refused")
        mass = math.fsum(map(math.exp, lps))
        if not mass <= 1 + MASS_SLACK:
            raise LlmqError(f"{self.ep.base} answered probabilities summing to {mass:.6g} at one position: no "
                            "distribution holds more than 1; refused")

    def _positions(self, tokens: list[int], k: int) -> list[dict[int, float]]:
        """{token id: logprob} of the distribution after each of tokens[:-1], its top k at least."""
        if self.shape in PROMPT_SHAPES:
            return self._prompts([tokens], k)[0]
        if self.shape is None:
            raise LlmqError(self.refusal("logprobs"))
        reqs = [self._body(self.shape, tokens[:i], k) for i in range(1, len(tokens))]
        answers = self._post_all(reqs[0][0], [b for _, b in reqs], progress=False) if reqs else []
        return self._checked([e for a in answers for e in (self._parse(self.shape, a, []) or [None])], len(reqs))

    # -- EvalLM's hooks -----------------------------------------------------------------------------------------------
    def _forced(self, items: list[ScoreRequest]) -> list[Score]:
        """llama-server scoring: one /completion a scored token, its prefix as the prompt (the server's prompt cache
        keeps the prefix) and that token forced by a logit bias; its reported logprob is the raw model's."""
        jobs = [(it.token_ids[:j], it.token_ids[j]) for it in items for j in range(it.start, len(it.token_ids))]
        bodies = [{"prompt": ids, "n_predict": 1, "n_probs": 1, "temperature": -1, "cache_prompt": True,
                   "logit_bias": [[tok, FORCE_BIAS]]} for ids, tok in jobs]
        answers = iter(self._post_all("/completion", bodies, progress=False))
        out = []
        for it in items:
            logprob, greedy = 0.0, True
            for tok in it.token_ids[it.start:]:
                try:
                    got = next(answers)["completion_probabilities"][0]
                    gid, lp, top = int(got["id"]), float(got["logprob"]), int(got["top_logprobs"][0]["id"])
                except (KeyError, IndexError, TypeError, ValueError):
                    raise LlmqError(f"{self.ep.base}/completion answered n_probs in an unexpected shape") from None
                if gid != tok:
                    raise LlmqError(f"{self.ep.base} ignored logit_bias (generated token {gid}, forced {tok}): it "
                                    "cannot score given text this way")
                self._possible([lp])
                logprob, greedy = logprob + lp, greedy and top == tok
            out.append(Score(logprob, greedy))
            self.progress(0, 1)
        return out

    def score(self, items: list[ScoreRequest]) -> list[Score]:
        if not self.scores_prompts:
            raise LlmqError(self.refusal("scoring given text"))
        if self.shape == "n_probs":
            return self._forced(items)
        out = []
        for it, pos in zip(items, self._prompts([it.token_ids for it in items], 1, progress=True)):
            lps = pos[it.start - 1:]
            targets = it.token_ids[it.start:]
            out.append(Score(sum(lp[t] for lp, t in zip(lps, targets)),
                             all(max(lp, key=lp.get) == t for lp, t in zip(lps, targets))))
        return out

    def generate_ids(self, prompts, max_tokens, stops, temperatures, skip_special=True) -> list[Generation]:
        bodies = [{"model": self.ep.model, "prompt": ids, "max_tokens": n, "temperature": t, "seed": self.seed + i,
                   **({"stop": s} if s else {}), **({} if skip_special else {"skip_special_tokens": False})}
                  for i, (ids, n, s, t) in enumerate(zip(prompts, max_tokens, stops, temperatures))]
        texts = []
        for data in self._post_all("/v1/completions", bodies):
            try:
                choice = data["choices"][0]
                texts.append(Generation(str(choice["text"]), choice.get("finish_reason") == "stop"))
            except (KeyError, IndexError, TypeError, AttributeError):
                raise LlmqError(f"{self.ep.base}/v1/completions answered without choices[0].text; is this an "
                                "OpenAI-compatible endpoint?") from None
        return texts

    def generate_images(self, items: list[tuple[list[dict], str, object]], max_tokens: int) -> list[Generation]:
        """Through /v1/chat/completions: each item's messages with its image as a `data:` PNG URL (the server's
        template and processor place it), greedy, seeded as generate_ids's."""
        import base64
        import io

        def url(image) -> str:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

        def parts(messages: list[dict], image) -> list[dict]:
            return [{**m, "content": [{"type": "image_url", "image_url": {"url": url(image)}} if p["type"] == "image"
                                      else p for p in m["content"]]} if isinstance(m["content"], list) else m
                    for m in messages]

        bodies = [{"model": self.ep.model, "messages": parts(messages, image), "max_tokens": max_tokens,
                   "temperature": 0.0, "seed": self.seed + i} for i, (messages, _, image) in enumerate(items)]
        out = []
        for data in self._post_all("/v1/chat/completions", bodies):
            try:
                choice = data["choices"][0]
                out.append(Generation(str(choice["message"]["content"] or ""), choice.get("finish_reason") == "stop"))
            except (KeyError, IndexError, TypeError, AttributeError):
                raise LlmqError(f"{self.ep.base}/v1/chat/completions answered without choices[0].message.content; "
                                "does it take image_url parts?") from None
        return out

    def logprobs_before(self, tokens: list[int]) -> torch.Tensor:
        """[T-1, vocab]: the whole distributions the server gives (top_k None) before each of tokens[1:]."""
        rows = self._positions(tokens, -1)
        vocab = len(rows[0])
        if any(len(r) != vocab for r in rows):
            raise LlmqError(f"{self.ep.base} answered distributions of different sizes for k = -1")
        out = torch.empty(len(rows), vocab, dtype=torch.float64)
        for i, r in enumerate(rows):
            out[i, list(r)] = torch.tensor(list(r.values()), dtype=torch.float64)
        return out

    def top_logprobs(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """([T-1, k] log-probabilities, descending, [T-1, k] token ids): the top k after each of tokens[:-1]."""
        rows = [sorted(p.items(), key=lambda kv: -kv[1])[:self.top_k] for p in self._positions(tokens, self.top_k)]
        if any(len(r) < self.top_k for r in rows):
            raise LlmqError(f"{self.ep.base} returned fewer than the {self.top_k} top logprobs asked for")
        return (torch.tensor([[v for _, v in r] for r in rows], dtype=torch.float64),
                torch.tensor([[t for t, _ in r] for r in rows], dtype=torch.int64))

    def close(self) -> None:
        pass


def _token_id(name: str) -> int:
    """N of "token_id:N" (return_tokens_as_token_ids); a token named by its text cannot be placed in the vocabulary."""
    if not name.startswith("token_id:"):
        raise ValueError(name)
    return int(name[len("token_id:"):])
