"""Iteration-level scheduling: which sequences run this step, with how many tokens each.

Every step spends a token budget. Running sequences go first (one token each when decoding, a chunk when still
prefilling), oldest first; then waiting sequences are admitted while budget, sequence slots and KV blocks last, the
last one admitted possibly with a partial (chunked) prefill. When a running sequence needs a block and none is free,
the youngest running sequence is preempted: its blocks are released and it is recomputed later (its full blocks
usually survive in the prefix cache, which makes the recompute cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences of one step and their number of new tokens; single-token entries first (the runner's fast path)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted = False
        # decodes before prefill chunks, so a long prompt never stalls the sequences that are generating
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
            cached = self.bm.match_prefix(seq) if not seq.block_table else 0
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                self.bm.release(seq)
                break
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
        items = sorted(chosen.items(), key=lambda c: c[1] != 1)  # stable: decodes first, then prefill chunks
        return ScheduledBatch([c[0] for c in items], [c[1] for c in items])
