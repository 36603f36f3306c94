"""lm-evaluation-harness `LM` backends: the bundled runtime (what llmq serves) and transformers (for comparison).

Both share lm-eval's tokenization conventions (trailing context whitespace moves to the continuation; an empty
context is conditioned on the end-of-text token) and its rolling windows, and differ only in how a batch of
scoring items or prompts is computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..errors import LlmqError
from ..runtime import ScoreRequest

DEFAULT_MAX_LENGTH = 2048
DEFAULT_GEN_TOKENS = 256

ProgressFn = Callable[[int, int], None]  # (new items to do, items done)


@dataclass
class Score:
    logprob: float  # sum of log p(tokens[i] | tokens[:i]) over the scored tokens
    greedy: bool  # every scored token was the argmax


@dataclass
class Generation:
    text: str
    ended: bool  # it stopped at an end-of-sequence token or a stop string, not at its token budget


class EvalLM(LM):
    """The backend-independent half: request → token items, results → lm-eval's answers. `top_k`: None when KL
    divergence reads whole distributions, else how many of the top logprobs a position gives (what an endpoint
    returns; set on an in-process model, the KL is computed the same top-k way, to compare with an endpoint's)."""

    top_k: int | None = None

    def __init__(self, tokenizer, max_length: int, seed: int = 0, progress: ProgressFn | None = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.seed = seed
        self.progress = progress or (lambda todo, done: None)
        eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        if eot is None:
            raise LlmqError("the tokenizer has neither an end-of-text nor a beginning-of-text token")
        self.prefix_token_id = int(eot)
        self.calls = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}
        self.seconds = {k: 0.0 for k in self.calls}  # wall time per request type, for the report

    # -- backend hooks -------------------------------------------------------------------------------------------
    def score(self, items: list[ScoreRequest]) -> list[Score]:
        raise NotImplementedError

    def generate_ids(self, prompts: list[list[int]], max_tokens: list[int], stops: list[list[str]],
                     temperatures: list[float], skip_special: bool = True) -> list[Generation]:
        """Each prompt's answer; skip_special False keeps special tokens in the text (a chat format's markers)."""
        raise NotImplementedError

    def full_logprobs(self, tokens: list[int]) -> torch.Tensor:
        """[T, vocab] log-softmax of the next-token distribution after each of tokens (T <= max_length)."""
        raise NotImplementedError

    def logprobs_before(self, tokens: list[int]) -> torch.Tensor:
        """[T-1, vocab]: the distributions before each of tokens[1:] (what KLD compares; all an endpoint gives)."""
        return self.full_logprobs(tokens)[:-1]

    def top_logprobs(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """([T-1, k] log-probabilities, descending, [T-1, k] token ids): the top k before each of tokens[1:]."""
        return self.logprobs_before(tokens).double().topk(self.top_k, dim=-1)

    def generate_images(self, items: list[tuple[list[dict], str, object]], max_tokens: int) -> list[Generation]:
        """Greedy answers to (messages, their rendered prompt, the image) items: the images task's."""
        raise LlmqError(f"the images task is asked through llmq's runtime or an endpoint, not the "
                        f"{type(self).__name__} backend")

    def image_logprobs(self, tokens: list[int], pixels: torch.Tensor) -> torch.Tensor | None:
        """[T, vocab] log-softmax after each of a vision-language prompt's tokens, its images' pixels in place;
        None where this backend cannot (the KLD on image-conditioned text is then not measured)."""
        return None

    # -- tokenization --------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _pair_item(self, context: str, continuation: str) -> ScoreRequest:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        if context:
            whole = self.encode(context + continuation)
            ctx = self.encode(context)
            cont = whole[len(ctx):]
            if whole[:len(ctx)] != ctx:  # the merge crossed the boundary: keep the context's own tokens
                cont = self.encode(continuation)
        else:
            ctx, cont = [self.prefix_token_id], self.encode(continuation)
        if not cont:
            raise LlmqError(f"continuation {continuation!r} encodes to no tokens")
        tokens = (ctx + cont)[-self.max_length:]
        return ScoreRequest(tokens, max(1, len(tokens) - len(cont)))

    # -- lm-eval's interface ---------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.calls["loglikelihood"] += 1
        items = [self._pair_item(*r.args[:2]) for r in requests]
        self.progress(len(items), 0)
        t = time.monotonic()
        out = [(s.logprob, s.greedy) for s in self.score(items)]
        self.seconds["loglikelihood"] += time.monotonic() - t
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self.calls["loglikelihood_rolling"] += 1
        items, owner = [], []
        for i, r in enumerate(requests):
            # a window of max_length - 1 inputs plus its last target fits the context the scorer feeds
            windows = get_rolling_token_windows(self.encode(r.args[0]), self.prefix_token_id, self.max_length - 1, 1)
            for ctx, pred in map(make_disjoint_window, windows):
                items.append(ScoreRequest(ctx + pred, len(ctx)))
                owner.append(i)
        self.progress(len(items), 0)
        t = time.monotonic()
        totals = [0.0] * len(requests)
        for i, s in zip(owner, self.score(items)):
            totals[i] += s.logprob
        self.seconds["loglikelihood_rolling"] += time.monotonic() - t
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.calls["generate_until"] += 1
        prompts, max_tokens, stops, temps = [], [], [], []
        for r in requests:
            context, kw = r.args[0], dict(r.args[1] or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.pop("max_gen_toks", DEFAULT_GEN_TOKENS))
            temp = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            ids = self.encode(context) or [self.prefix_token_id]
            keep = self.max_length - n
            if keep < 1:
                raise LlmqError(f"max_gen_toks {n} leaves no room for a prompt in {self.max_length} tokens")
            prompts.append(ids[-keep:])
            max_tokens.append(n)
            stops.append(until)
            temps.append(temp)
        self.progress(len(prompts), 0)
        t = time.monotonic()
        out = self.generate_ids(prompts, max_tokens, stops, temps)
        self.seconds["generate_until"] += time.monotonic() - t
        return [g.text for g in out]


class LlmqLM(EvalLM):
    """The model exactly as the bundled runtime serves it: paged KV cache (KV quantization included), its layers."""

    def __init__(self, path: str | Path, seed: int = 0, progress: ProgressFn | None = None,
                 max_length: int = DEFAULT_MAX_LENGTH, engine_config=None, speculative: dict | None = None):
        from ..runtime.engine import EngineConfig, LLMEngine

        # a modest KV budget: scoring items are short, and an evaluation may hold the baseline's engine too
        cfg = engine_config or EngineConfig(max_num_seqs=32, kv_cache_fraction=0.08, **(speculative or {}))
        self.engine = LLMEngine(path, cfg)
        super().__init__(self.engine.tokenizer, min(max_length, self.engine.max_model_len), seed, progress)
        self.score_stats = {"computed_tokens": 0, "reused_tokens": 0}  # reused: served from the prefix cache

    def score(self, items: list[ScoreRequest]) -> list[Score]:
        outs = self.engine.score(items, progress=lambda n: self.progress(0, n))
        for it, o in zip(items, outs):
            self.score_stats["reused_tokens"] += o.num_cached_tokens
            self.score_stats["computed_tokens"] += len(it.token_ids) - o.num_cached_tokens
        return [Score(sum(o.logprobs), all(o.greedy)) for o in outs]

    def generate_ids(self, prompts, max_tokens, stops, temperatures, skip_special=True) -> list[Generation]:
        from ..runtime.sampling import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=t, seed=self.seed + i, stop=s,
                                 skip_special_tokens=skip_special)
                  for i, (n, s, t) in enumerate(zip(max_tokens, stops, temperatures))]
        texts = []
        step = 4 * self.engine.max_num_seqs  # progress granularity; the engine batches within each slice
        for i in range(0, len(prompts), step):
            outs = self.engine.generate(prompts[i:i + step], params[i:i + step])
            texts.extend(Generation(o.text, o.finish_reason == "stop") for o in outs)
            self.progress(0, len(outs))
        return texts

    def full_logprobs(self, tokens: list[int]) -> torch.Tensor:
        return self.engine.prompt_logprobs(tokens)

    def image_logprobs(self, tokens: list[int], pixels: torch.Tensor) -> torch.Tensor | None:
        from ..models.vision import runs_images

        return self.engine.prompt_logprobs(tokens, pixels) if runs_images(self.engine.spec.vision) else None

    def generate_images(self, items: list[tuple[list[dict], str, object]], max_tokens: int) -> list[Generation]:
        from ..models.vision import runs_images
        from ..runtime.images import ImagePrompt
        from ..runtime.sampling import SamplingParams

        if not runs_images(self.engine.spec.vision):
            raise LlmqError(f"the images task asks a vision-language model about images; this model "
                            f"({self.engine.spec.architecture}) takes none")
        prompt = ImagePrompt(self.engine.path)
        placed = [prompt(text, [image]) for _, text, image in items]
        outs = self.engine.generate([ids for ids, _ in placed],
                                    [SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=self.seed + i)
                                     for i in range(len(placed))], images=[pixels for _, pixels in placed])
        self.progress(0, len(outs))
        return [Generation(o.text, o.finish_reason == "stop") for o in outs]

    def close(self) -> None:
        self.engine.shutdown()


class HFLM(EvalLM):
    """The checkpoint through transformers (dense or dequantized weights, no paged cache): a reference backend."""

    def __init__(self, path: str | Path, seed: int = 0, progress: ProgressFn | None = None,
                 max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 8, device: str | None = None):
        from ..models import load_hf_model, load_tokenizer, pick_device

        self.torch_device = torch.device(pick_device(device))
        self.model = load_hf_model(path, dtype=torch.float32, device=str(self.torch_device))
        limit = getattr(self.model.config, "max_position_embeddings", max_length) or max_length
        super().__init__(load_tokenizer(path), min(max_length, limit), seed, progress)
        self.batch_size = batch_size

    @torch.inference_mode()
    def _logits(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.tensor([t + [self.prefix_token_id] * (width - len(t)) for t in batch], device=self.torch_device)
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in batch], device=self.torch_device)
        return self.model(input_ids=ids, attention_mask=mask).logits.float()

    def score(self, items: list[ScoreRequest]) -> list[Score]:
        order = sorted(range(len(items)), key=lambda i: -len(items[i].token_ids))  # similar lengths share a batch
        out: list[Score | None] = [None] * len(items)
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            logits = self._logits([items[i].token_ids for i in idx])
            for row, i in enumerate(idx):
                it = items[i]
                lsm = logits[row, it.start - 1:len(it.token_ids) - 1].log_softmax(-1)
                tgt = torch.tensor(it.token_ids[it.start:], device=lsm.device)
                out[i] = Score(float(lsm.gather(1, tgt[:, None]).sum()), bool((lsm.argmax(-1) == tgt).all()))
            self.progress(0, len(idx))
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def generate_ids(self, prompts, max_tokens, stops, temperatures, skip_special=True) -> list[Generation]:
        texts = []
        for i, (ids, n, stop, temp) in enumerate(zip(prompts, max_tokens, stops, temperatures)):
            torch.manual_seed(self.seed + i)
            x = torch.tensor([ids], device=self.torch_device)
            kw = dict(do_sample=True, temperature=temp) if temp > 0 else dict(do_sample=False)
            if stop:
                kw.update(stop_strings=stop, tokenizer=self.tokenizer)
            gen = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      pad_token_id=self.prefix_token_id, **kw)
            new = gen[0, len(ids):]
            eos = self.model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [self.prefix_token_id])
            ended = len(new) > 0 and int(new[-1]) in eos
            # the end token is not the answer's text (as the runtime leaves it out)
            text = self.tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=skip_special)
            cut = min((j for j in (text.find(s) for s in stop) if j >= 0), default=-1)
            texts.append(Generation(text[:cut] if cut >= 0 else text, cut >= 0 or ended))
            self.progress(0, 1)
        return texts

    def full_logprobs(self, tokens: list[int]) -> torch.Tensor:
        return self._logits([list(tokens)])[0].log_softmax(-1).cpu()

    def close(self) -> None:
        pass


def make_lm(backend: str, path: str | Path, seed: int = 0, progress: ProgressFn | None = None,
            speculative: dict | None = None) -> EvalLM:
    """speculative: EngineConfig's speculative fields (the bundled runtime only)."""
    if backend == "llmq":
        return LlmqLM(path, seed=seed, progress=progress, speculative=speculative)
    if backend == "hf":
        return HFLM(path, seed=seed, progress=progress)
    raise LlmqError(f"unknown backend {backend!r}; choose llmq or hf")
