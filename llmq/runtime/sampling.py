"""Sampling parameters and the batched sampler: one call turns a step's logits into next tokens (and logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import LlmqError

if TYPE_CHECKING:
    from .grammar import Grammar

# below this temperature, logits / temperature overflows float32 and the softmax turns to NaN: sample greedily
MIN_TEMPERATURE = 1e-5
TOP_K_MAX = 2**63 - 1  # an int64 tensor holds it (then clamped to the vocabulary)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0 = only the sampled token's
    prompt_logprobs: int | None = None  # top-N logprobs before each prompt token after the first (PromptLogprobs)
    skip_special_tokens: bool = True  # the text leaves special tokens out (as vLLM's field of the name)
    # a grammar.Grammar the output must follow (constrained decoding): its matcher masks the sequence's logits
    grammar: Grammar | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:  # 0: the prompt's KV (and prompt_logprobs)
            raise LlmqError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):
            raise LlmqError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not (0 < self.top_p <= 1):
            raise LlmqError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= TOP_K_MAX:
            raise LlmqError(f"top_k must be -1 (off) or a positive integer up to {TOP_K_MAX}, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise LlmqError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.grammar is not None and self.ignore_eos:
            raise LlmqError("ignore_eos cannot be combined with a grammar (it ends the answer with EOS)")
        for name in ("logprobs", "prompt_logprobs"):  # counts past the vocabulary mean all of it
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and n >= 0):
                raise LlmqError(f"{name} must be a non-negative integer, got {n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class NonFiniteLogits(RuntimeError):
    """The model produced NaN / inf logits: that request fails (a 500), the server goes on."""


def check_finite(logits: torch.Tensor) -> None:
    """NonFiniteLogits where a row holds NaN or +inf (or only -inf): a broken model, whose tokens would be noise and
    whose logprobs no JSON can carry."""
    top = logits.amax(-1)  # NaN wherever a row holds one, +inf likewise
    if not bool(torch.isfinite(top).all()):
        raise NonFiniteLogits(f"the model's logits are not finite (largest {top.tolist()[:4]}): NaN or inf in its "
                              "weights or activations")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator, so a seeded request samples the same tokens whatever else shares its batch."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def _filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tail of descending-sorted logits beyond each row's top-k and top-p nucleus."""
    rank = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    drop = rank[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(-1)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False  # the most likely token survives any top_p, even one that rounds to 0 in float32
    return sorted_logits.masked_fill(drop, float("-inf"))


def _processed(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampling distribution of every row (none greedy): temperature, then top-k / top-p. Returns (probs, order):
    with top-k / top-p the probs are over the descending-sorted vocabulary and order maps them back, else order is
    None."""
    temp = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    scaled = logits / temp[:, None]
    if not any(p.top_k > 0 or p.top_p < 1 for p in params):
        return scaled.softmax(-1), None
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    scaled, order = scaled.sort(-1, descending=True)
    return _filter_sorted(scaled, top_k, top_p).softmax(-1), order


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] probabilities that sample() draws each row's token from (in vocabulary order); rows must not be greedy."""
    probs, order = _processed(logits, params)
    return probs if order is None else torch.zeros_like(probs).scatter_(-1, order, probs)


def logprob_entries(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
                    ) -> list[dict[int, float] | None]:
    """{token: logprob} per row where logprobs were asked (the chosen token's, plus the top-N): the model's raw
    distribution, before temperature / top-k / top-p, as in vLLM."""
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        lsm = logits.index_select(0, torch.tensor(rows, device=logits.device)).log_softmax(-1)
        for i, e in zip(rows, _entries(lsm, [tokens[i] for i in rows], [params[i].logprobs for i in rows])):
            out[i] = e
    return out


def _entries(lsm: torch.Tensor, tokens: list[int], ns: list[int]) -> list[dict[int, float]]:
    """Per row of log-probabilities: {token: logprob} of its token first, then its top n (past the vocabulary: all);
    read back to the host in one transfer each, not one a value (a GPU sync each)."""
    own = lsm.gather(1, torch.tensor(tokens, device=lsm.device)[:, None])[:, 0].tolist()
    k = min(max(ns, default=0), lsm.shape[-1])
    vals, ids = (x.tolist() for x in lsm.topk(k, -1)) if k else ([], [])
    out = []
    for j, (t, n) in enumerate(zip(tokens, ns)):
        entry = {t: own[j]}
        for tok, v in zip(ids[j][:n], vals[j][:n]) if n else ():
            entry.setdefault(tok, v)
        out.append(entry)
    return out


@dataclass
class PromptLogprobs:
    """The distributions before a prompt's tokens after the first (vLLM's prompt_logprobs), filled as its prefill
    chunks run: per position, {token: logprob} of the prompt token there and the top n, and that token's rank in
    the whole vocabulary (1 = most likely; tokens tied with it count, as in vLLM)."""

    entries: list[dict[int, float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def add(self, logits: torch.Tensor, tokens: list[int], n: int) -> None:
        """Append the positions whose logits are the rows of `logits`, before `tokens` (NonFiniteLogits: none)."""
        check_finite(logits)
        lsm = logits.float().log_softmax(-1)
        own = lsm.gather(1, torch.tensor(tokens, device=lsm.device)[:, None])
        self.ranks += (lsm >= own).sum(-1).tolist()
        self.entries += _entries(lsm, tokens, [n] * len(tokens))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           matchers: list | None = None) -> tuple[list[int], list[dict[int, float] | None]]:
    """Next token per row of `logits` [B, V] (float32), plus {token: logprob} dicts where logprobs were asked
    (NonFiniteLogits: see check_finite). matchers: per row, the grammar matcher whose mask limits its tokens, or
    None (the masks of all constrained rows are filled in one call; unconstrained rows pay nothing else). Logprobs
    are the model's distribution, before the mask, as before temperature."""
    check_finite(logits)
    raw = logits
    if matchers is not None and any(m is not None for m in matchers):
        from .grammar import constrain

        logits = constrain(logits, matchers)
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs, order = _processed(logits.index_select(0, torch.tensor(rows, device=logits.device)),
                                  [params[i] for i in rows])
        for j, i in enumerate(rows):
            pick = torch.multinomial(probs[j], 1, generator=generators[i])
            tokens[i] = order[j, pick[0]] if order is not None else pick[0]
    token_list = tokens.tolist()
    return token_list, logprob_entries(raw, token_list, params)
