"""Scoring: log-probabilities of given tokens (eval's loglikelihoods) and whole next-token distributions, computed
by a worker over sequences admitted through the scheduler's admission (Scheduler.admit), never cached beyond it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import LlmqError
from .sampling import SamplingParams
from .scheduler import Scheduler, decodes_first
from .sequence import Sequence
from .worker import Worker

LOOKAHEAD = 4  # score requests considered for admission per sequence slot


@dataclass
class ScoreRequest:
    """Score token_ids[start:], each token given every token before it (1 <= start < len(token_ids))."""

    token_ids: list[int]
    start: int


@dataclass
class ScoreOutput:
    logprobs: list[float] = field(default_factory=list)  # log p(token_ids[i] | token_ids[:i]) for i >= start
    greedy: list[bool] = field(default_factory=list)  # whether token_ids[i] was the most likely next token
    num_cached_tokens: int = 0  # leading tokens whose KV came from the prefix cache


@dataclass
class _Scoring:
    """A score request in flight: its sequence and the prefix-cache keys of all its full blocks."""

    index: int
    request: ScoreRequest
    seq: Sequence
    keys: list[tuple]
    out: ScoreOutput


class Scorer:
    def __init__(self, worker: Worker, scheduler: Scheduler):
        self.worker = worker
        self.scheduler = scheduler
        self.bm = scheduler.bm

    def prompt_logprobs(self, token_ids: list[int], images: tuple = ()) -> torch.Tensor:
        """[T, vocab] log-softmax of the next-token distribution after each position, through the paged path;
        images: a vision-language prompt's ImageSpans (LLMEngine.prompt_logprobs places them).

        Runs in chunks of the step budget (never ending inside an image) on blocks of its own, which are released
        afterwards and never cached.
        """
        ids = list(token_ids)
        limit = self.worker.max_model_len
        if not ids or len(ids) > limit:
            raise LlmqError(f"prompt_logprobs needs 1..{limit} tokens, got {len(ids)}")
        seq = Sequence("prompt-logprobs", ids, SamplingParams(max_tokens=1, temperature=0), None, images)
        if not self.bm.allocate(seq, len(ids)):
            raise LlmqError(f"not enough free KV blocks for a {len(ids)}-token sequence right now")
        out = []
        try:
            budget = self.scheduler.max_num_batched_tokens
            while seq.num_computed_tokens < len(ids):
                n = seq.chunk(budget)
                out.append(self.worker.run([seq], [n], all_logits=True).log_softmax(-1))
                seq.num_computed_tokens += n
        finally:
            self.bm.release(seq)
        return torch.cat(out).cpu()

    def score(self, requests: list[ScoreRequest], progress: Callable[[int], None] | None = None
              ) -> list[ScoreOutput]:
        """Log-probabilities of every request's scored tokens, several sequences per step (chunked to the budget).

        Requests that share a prefix (one few-shot prompt, one question with several answers) compute it once
        through the prefix cache: a request is admitted only when no request in flight is still computing blocks
        it could reuse. Sorting by tokens makes such requests neighbours. progress(n) counts finished requests.
        For whole next-token distributions, see prompt_logprobs.
        """
        if self.scheduler.has_unfinished():
            raise LlmqError("the engine is serving requests; scoring needs it to itself")
        limit = self.worker.max_model_len
        for r in requests:
            if not 1 <= r.start < len(r.token_ids) or len(r.token_ids) > limit:
                raise LlmqError(f"cannot score {len(r.token_ids)} tokens from {r.start} (context {limit})")
        pending = sorted(range(len(requests)), key=lambda i: requests[i].token_ids)
        results: list[ScoreOutput | None] = [None] * len(requests)
        active: list[_Scoring] = []
        try:
            while pending or active:
                pending = self._admit(requests, pending, active)
                if not active:
                    raise LlmqError("the KV cache cannot hold one scoring request; give it more memory")
                done = self._step(active)
                for a in done:
                    self.bm.release(a.seq)
                    active.remove(a)
                    results[a.index] = a.out
                if done and progress is not None:
                    progress(len(done))
        finally:
            for a in active:
                self.bm.release(a.seq)
        return results  # type: ignore[return-value]

    def _admit(self, requests: list[ScoreRequest], pending: list[int], active: list[_Scoring]) -> list[int]:
        """Admit pending requests (from a lookahead window) into `active` while slots and blocks last, except those
        whose shareable blocks another active request is still computing; returns the still pending."""
        bm, bs, slots = self.bm, self.bm.block_size, self.scheduler.max_num_seqs
        computing = {k for a in active for k in a.keys[a.seq.num_computed_tokens // bs:]}
        kept = []
        for pos, i in enumerate(pending):
            if pos >= LOOKAHEAD * slots or len(active) >= slots:
                return kept + pending[pos:]
            r = requests[i]
            seq = Sequence(f"score-{i}", r.token_ids, SamplingParams(max_tokens=1, temperature=0))

            def shares_in_flight(s: Sequence, r=r) -> bool:  # blocks it could reuse, still being computed
                keys = bm.block_keys(r.token_ids, (r.start - 1) // bs, len(s.block_table), s.last_block_key)
                return any(k in computing for k in keys)

            cached = self.scheduler.admit(seq, len(r.token_ids), match_limit=r.start, hold=shares_in_flight)
            if cached is None:  # wait for the request computing these blocks (or for free blocks)
                kept.append(i)
                continue
            a = _Scoring(i, r, seq, list(bm.block_keys(r.token_ids, len(r.token_ids) // bs)),
                         ScoreOutput(num_cached_tokens=cached))
            active.append(a)
            computing.update(a.keys[cached // bs:])
        return kept

    def _step(self, active: list[_Scoring]) -> list[_Scoring]:
        """One step over the requests in flight (within the token budget); returns those it finished."""
        chunks, sizes, left = [], [], self.scheduler.max_num_batched_tokens
        for a in active:
            if left == 0:
                break
            n = min(len(a.request.token_ids) - a.seq.num_computed_tokens, left)
            chunks.append(a)
            sizes.append(n)
            left -= n
        chunks, sizes = decodes_first(chunks, sizes)
        rows, targets, owners, q0 = [], [], [], 0
        for a, n in zip(chunks, sizes):
            st, toks = a.seq.num_computed_tokens, a.request.token_ids
            for p in range(max(st, a.request.start - 1), min(st + n, len(toks) - 1)):
                rows.append(q0 + p - st)
                targets.append(toks[p + 1])
                owners.append(a)
            q0 += n
        # a step scoring nothing runs for its KV
        logits = self.worker.run([a.seq for a in chunks], sizes, rows=rows or [0])
        if rows:
            lsm = logits.float().log_softmax(-1)
            tgt = torch.tensor(targets, device=lsm.device)
            for a, lp, hit in zip(owners, lsm.gather(1, tgt[:, None])[:, 0].tolist(),
                                  (lsm.argmax(-1) == tgt).tolist()):
                a.out.logprobs.append(lp)
                a.out.greedy.append(hit)
        done = []
        for a, n in zip(chunks, sizes):
            a.seq.num_computed_tokens += n
            self.bm.commit(a.seq)
            if a.seq.num_computed_tokens == len(a.request.token_ids):
                done.append(a)
        return done
