"""Iteration-level scheduling: which sequences run this step, with how many tokens each, and what their new tokens
mean for them (the stop and finish decisions).

Every step spends a token budget. Running sequences go first (one token each when decoding, a chunk when still
prefilling), oldest first; then waiting sequences are admitted while budget, sequence slots and KV blocks last, the
last one admitted possibly with a partial (chunked) prefill. When a running sequence needs a block and none is free,
the youngest running sequence is preempted: its blocks are released and it is recomputed later (its full blocks
usually survive in the prefix cache, which makes the recompute cheap). With a speculator, decoding sequences get
draft tokens to verify in the same step.

schedule() returns the step as a record (SchedulerOutput); after the worker ran it, update() appends each sequence's
new tokens and finishes it at a stop token, a stop string or its length limit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

T = TypeVar("T")


def decodes_first(items: list[T], num_new: list[int]) -> tuple[list[T], list[int]]:
    """Entries of one step with a single new token first, otherwise in the given order: the order the model runner
    requires (its batched decode path), for every caller that builds a step."""
    order = sorted(range(len(items)), key=lambda i: num_new[i] != 1)
    return [items[i] for i in order], [num_new[i] for i in order]


class LogitsRows(NamedTuple):
    """The positions whose logits a step needs, as rows of the logits the worker returns."""

    samplers: list[Sequence]                          # the sequences that sample a token this step
    rows: list[int]                                   # each sampler's row (its last position)
    spec_rows: list[int]                              # every row of the verifications of drafts
    prompt_rows: list[tuple[Sequence, list[int]]]     # per sequence collecting prompt log-probabilities, its rows
    wanted: list[int]                                 # the flat token position of every row


@dataclass
class SchedulerOutput:
    """One step: sequences and their numbers of new tokens, single-token entries first. drafts: the speculating
    sequences' draft tokens (appended to them and counted in num_new_tokens) with the draft's q (None: a point
    mass), to verify in this step."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    drafts: dict[Sequence, tuple[list[int], torch.Tensor | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)

    def logits_rows(self) -> LogitsRows:
        """The positions whose logits the step needs: a sampler's last, a verification's every one and the prompt
        positions a sequence asked log-probabilities for (Sequence.next_prompt_logprob onwards)."""
        samplers: list[Sequence] = []
        rows: list[int] = []
        spec_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, list[int]]] = []
        wanted: list[int] = []
        q0 = 0
        for seq, n in zip(self.seqs, self.num_new_tokens):
            st, p0 = seq.num_computed_tokens, seq.next_prompt_logprob
            if seq in self.drafts:
                spec_rows.extend(range(len(wanted), len(wanted) + n))
                wanted.extend(range(q0, q0 + n))
            else:
                if p0 is not None and (ps := range(max(st, p0), min(st + n, seq.num_prompt_tokens - 1))):
                    prompt_rows.append((seq, list(range(len(wanted), len(wanted) + len(ps)))))
                    wanted.extend(q0 + p - st for p in ps)
                if st + n == seq.num_tokens:
                    samplers.append(seq)
                    rows.append(len(wanted))
                    wanted.append(q0 + n - 1)
            q0 += n
        return LogitsRows(samplers, rows, spec_rows, prompt_rows, wanted)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, tokenizer, eos_token_ids: set[int]):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_generated_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def admit(self, seq: Sequence, budget: int, match_limit: int | None = None,
              hold: Callable[[Sequence], bool] | None = None) -> int | None:
        """The one admission of a sequence: attach its longest cached prefix (of its first match_limit tokens) unless
        it holds blocks, then blocks for up to `budget` more tokens, all or nothing. Returns the cached tokens, or
        None (the sequence holding nothing) when the blocks are not free or hold(seq) says to wait."""
        cached = self.bm.match_prefix(seq, match_limit) if not seq.block_table else 0
        if (hold is not None and hold(seq)) or not self.bm.allocate(seq, seq.num_computed_tokens + seq.chunk(budget)):
            self.bm.release(seq)
            return None
        return cached

    def schedule(self, speculator=None) -> SchedulerOutput:
        """This step's record; `speculator` (speculative.Speculator) drafts for its decoding sequences."""
        budget = self.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted = False
        # decodes before prefill chunks, so a long prompt never stalls the sequences that are generating
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget <= 0:  # below 0: a chunk took a whole image past it (Sequence.chunk)
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = seq.chunk(budget)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                preempted = True
                victim = self.running[-1]  # the youngest
                self._preempt(victim)
                budget += chosen.pop(victim, 0)
                if victim is seq:
                    break
            else:
                chosen[seq] = n
                budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            p0 = seq.next_prompt_logprob  # the positions still to score are computed, not read from the cache
            cached = self.admit(seq, budget, None if p0 is None else p0 + 1)
            if cached is None:
                break
            n = seq.chunk(budget)
            if not seq.admitted:  # count the prompt once, not again after a preemption
                seq.admitted = True
                seq.num_cached_tokens = cached
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
        out = SchedulerOutput(*decodes_first(list(chosen), list(chosen.values())))
        if speculator is not None and len(out):
            out.drafts = speculator.draft(out.seqs, out.num_new_tokens, len(self.running),
                                          self.max_num_batched_tokens, self.bm, self.max_model_len)
            if out.drafts:  # verifications are chunks now
                out.seqs, out.num_new_tokens = decodes_first(out.seqs, out.num_new_tokens)
        return out

    # -- after the step ran ------------------------------------------------------------------------------------------
    def take_back_drafts(self, out: SchedulerOutput) -> None:
        """Remove the step's draft tokens from their sequences (before verification, or when the step failed)."""
        for seq, (draft, _) in out.drafts.items():
            del seq.token_ids[-len(draft):]

    def computed(self, out: SchedulerOutput) -> None:
        """The step's tokens have KV now, except drafts (their verification decides): commit the full blocks."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq not in out.drafts:
                seq.num_computed_tokens += n
                self.bm.commit(seq)

    def update(self, seq: Sequence, tokens: list[int], logprobs: list[dict | None], now: float,
               verified: bool = False) -> None:
        """Append a step's new tokens to a sequence, finishing it where one stops it. verified: they are the accepted
        drafts (whose KV the step computed) and the target's next token; the rejected drafts' blocks are freed."""
        base = seq.num_tokens
        for token, lp in zip(tokens, logprobs):
            self._append(seq, token, lp, now)
            if seq.is_finished:
                return
        if verified:
            seq.num_computed_tokens = base + len(tokens) - 1
            self.bm.commit(seq)
            self.bm.trim(seq, seq.num_tokens)

    def _append(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> None:
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        reason = None
        end = seq.num_tokens
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
            end -= 1  # the stop token is not text
        length = seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        before = len(seq.text)
        seq.text = seq.detokenizer.update(self.tokenizer, seq.token_ids, end, reason is not None or length)
        if p.stop and len(seq.text) > before:  # a stop string ending in the new text
            since = max(0, before - max(map(len, p.stop)) + 1)
            cut = min((i for i in (seq.text.find(s, since) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and length:
            reason = "length"
        if reason is not None:
            self.finish(seq, reason)
            seq.finished_time = now
