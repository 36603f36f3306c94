"""Speculative decoding: a cheap proposer guesses a decoding sequence's next k tokens, and the target model scores all
k + 1 positions in one step (a chunk of the ordinary continuous batch), keeping the longest prefix it agrees with.

Lossless: greedy sequences keep a draft token only where it is the target's argmax, so their output is what plain
greedy decoding gives; sampled sequences use rejection sampling (accept draft d with probability min(1, p(d) / q(d)),
on rejection draw from the residual max(0, p - q), normalized), which leaves each token distributed exactly as the
target's p (Leviathan et al. 2023; Chen et al. 2023). A proposer that returns no q proposes deterministically (q is
a point mass).

A draft is appended to its sequence only for the step that verifies it (Scheduler.schedule asks the Speculator for
it); rejected tokens' KV slots are dropped afterwards (the sequence's computed count never covers them, tail blocks
holding only them are freed), and the prefix cache hashes a block only once it is computed and verified, so no
rejected token enters a block key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import LlmqError
from .block_manager import BlockManager
from .config import EngineConfig
from .sampling import logprob_entries, target_probs
from .scheduler import decodes_first
from .sequence import Sequence
from .worker import ModelSource, Worker

NGRAM_MAX = 4  # the longest suffix looked up; longer matches are tried first
NGRAM_MIN = 2  # a single token's last occurrence predicts too little to be worth a verification


@dataclass
class SpecStats:
    """Running totals, under vLLM's names in /metrics: drafts (sequence-steps that speculated), draft tokens
    proposed, draft tokens accepted, and accepted tokens by draft position (for the per-position acceptance)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens (longest n
    first, from n_max down to n_min), or [] when the suffix never occurred before."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every window but the suffix itself
        hits = np.flatnonzero((windows == tokens[size - n:]).all(1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class Proposer:
    """What the Speculator asks of a proposer: drafts for sequences (and their q, or None: point masses); a proposer
    holding something per request or process frees it in collect / close."""

    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        raise NotImplementedError

    def collect(self) -> None:
        """Free what finished requests held (nothing, unless the proposer keeps state per request)."""

    def close(self) -> None:
        """Free what the proposer holds (nothing, unless it runs a model of its own)."""


class NgramProposer(Proposer):
    """Prompt lookup: copy what followed the last occurrence of the current suffix in the prompt and output."""

    name = "ngram"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], None]:
        return [ngram_lookup(np.asarray(s.token_ids), k) for s, k in zip(seqs, ks)], None


class DraftModelProposer(Proposer):
    """A draft model with the target's tokenizer (a smaller sibling, or the target's own INT4 artifact) proposes
    greedily, k decode steps of its own per engine step, batched over the speculating sequences, on a worker of its
    own (the draft model's runner, KV cache and blocks).

    It keeps a mirror sequence per request with a paged KV cache of its own (no prefix caching: rolled-back slots
    are rewritten in place). Each round it rolls the mirror back to the longest prefix the target kept, computes the
    tokens it has not seen (the verified tokens, or a whole prompt in budget-sized chunks), then drafts. A hybrid
    draft model's recurrent states keep a journal from its first fed draft token on (Worker.run's speculating), and
    go back to the kept prefix by it (Worker.settle).
    """

    name = "draft"

    def __init__(self, path: str, target):
        """A proposer for `target` (the LLMEngine it drafts for: its tokenizer, limits and device)."""
        from ..models import load_tokenizer

        src = ModelSource.of(path)
        if load_tokenizer(src.path).get_vocab() != target.tokenizer.get_vocab():
            raise LlmqError(f"draft model {path} has a different tokenizer than the target; speculative decoding "
                            "needs the same one")
        c = target.config
        self.worker = Worker(src, EngineConfig(
            max_num_seqs=target.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=target.max_model_len, block_size=target.block_size, kv_cache_fraction=c.kv_cache_fraction,
            enable_prefix_caching=False, device=str(target.device), dtype=c.dtype))
        self.budget = c.max_num_batched_tokens
        self.vocab_size = target.spec.vocab_size
        self.mirrors: dict[Sequence, Sequence] = {}  # target sequence -> the draft model's copy
        self.journals: dict[Sequence, int] = {}  # a hybrid draft's mirror -> its position where its journal began

    def collect(self) -> None:
        """Free the mirrors of finished requests."""
        for seq in [s for s in self.mirrors if s.is_finished]:
            m = self.mirrors.pop(seq)
            self.journals.pop(m, None)   # the slot's next sequence starts from position 0, which drops its journal
            self.worker.block_manager.release(m)

    def _sync(self, seq: Sequence, k: int) -> Sequence | None:
        """The mirror of `seq`, rolled back to what both agree on, with blocks for k drafts (None: no blocks)."""
        m = self.mirrors.get(seq)
        if m is None:
            m = self.mirrors[seq] = Sequence(seq.request_id, [], seq.params)
        same = 0
        for a, b in zip(m.token_ids[:m.num_computed_tokens], seq.token_ids):
            if a != b:
                break
            same += 1
        m.token_ids = list(seq.token_ids)
        kept = min(same, seq.num_tokens - 1)
        begun = self.journals.pop(m, None)
        if begun is not None:   # a hybrid draft: its states go back to `kept` by the journal (all of it if it holds)
            if kept >= begun:
                self.worker.settle(m.state_slot, kept - begun)
            else:   # nothing to go back by (not reached from a journal round): the prompt again, from position 0
                kept = 0
        m.num_computed_tokens = kept
        return m if self.worker.block_manager.allocate(m, seq.num_tokens + k) else None

    def _run(self, mirrors: list[Sequence], sizes: list[int], speculating: bool = False) -> dict[Sequence, int]:
        """One forward of the draft model over `sizes` tokens of each mirror; the greedy next token of those that
        reach their end. `speculating`: the mirrors' tokens from here on are drafts (a hybrid draft's journals
        begin)."""
        seqs, ns = decodes_first(mirrors, sizes)
        if speculating and self.worker.spec.linear_layers:
            self.journals.update((m, m.num_computed_tokens) for m in seqs)
        logits = self.worker.run(seqs, ns, speculating=seqs if speculating else [])
        for m, n in zip(seqs, ns):
            m.num_computed_tokens += n
        done = [m for m, n in zip(seqs, ns) if m.num_computed_tokens == m.num_tokens]
        return dict(zip(done, logits.argmax(-1).tolist()))

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], None]:
        mirrors = [self._sync(s, k) for s, k in zip(seqs, ks)]
        live = [(m, k) for m, k in zip(mirrors, ks) if m is not None]
        drafts: dict[Sequence, list[int]] = {m: [] for m, _ in live}
        budget = self.budget
        pending = [m for m, _ in live]
        while pending:  # catch up on unseen tokens (chunked like a prefill), then the first draft token
            batch, sizes, left = [], [], budget
            for m in pending:
                if left == 0:
                    break
                n = min(m.num_tokens - m.num_computed_tokens, left)
                batch.append(m)
                sizes.append(n)
                left -= n
            for m, t in self._run(batch, sizes).items():
                drafts[m].append(t)
            pending = [m for m in pending if m.num_computed_tokens < m.num_tokens]
        for r in range(1, max((k for _, k in live), default=0)):
            batch = [m for m, k in live if k > r and drafts[m][-1] < self.vocab_size]
            if not batch:
                break
            for m in batch:
                m.token_ids.append(drafts[m][-1])
            for m, t in self._run(batch, [1] * len(batch), speculating=r == 1).items():
                drafts[m].append(t)
        out = []
        for m in mirrors:
            d = drafts.get(m, []) if m is not None else []
            cut = next((i for i, t in enumerate(d) if t >= self.vocab_size), len(d))  # a padded-vocabulary id
            out.append(d[:cut])
        return out, None

    def close(self) -> None:
        self.worker.shutdown()


@dataclass
class Verified:
    tokens: list[int]  # the accepted draft tokens, then the target's own next token
    logprobs: list[dict[int, float] | None]
    accepted: int


def accept(probs: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator | None
           ) -> tuple[int, int]:
    """Rejection sampling over one sequence's k + 1 target distributions `probs` [k + 1, V] (after temperature /
    top-k / top-p) and its k draft tokens with their draft distributions q [k, V] (None: a point mass on each draft
    token). Returns (accepted drafts a, the token at position a): the residual's draw on a rejection, else a draw
    from probs[k]."""
    k = len(draft)
    idx = torch.arange(k, device=probs.device)
    d = torch.tensor(draft, device=probs.device)
    p_d = probs[idx, d]
    ratio = p_d if q is None else (p_d / q[idx, d]).clamp(max=1)
    u = torch.rand(k, generator=generator, device=probs.device)
    rejected = (u >= ratio).nonzero()
    a = int(rejected[0]) if len(rejected) else k
    if a == k:
        return k, int(torch.multinomial(probs[k], 1, generator=generator))
    residual = probs[a].clone()
    if q is None:
        residual[draft[a]] = 0
    else:
        residual = (residual - q[a]).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q: nothing to correct (reached only through rounding)
        residual = probs[a]
    return a, int(torch.multinomial(residual, 1, generator=generator))


def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None] | None = None) -> list[Verified]:
    """Each sequence's outcome from `logits`: its k + 1 rows (target logits at the last real token and at every draft
    token), sequence after sequence."""
    greedy_tokens = logits.argmax(-1).tolist()
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts]).tolist()
    probs = None
    if sampled:
        rows = torch.tensor([r for i in sampled for r in range(starts[i], starts[i + 1])], device=logits.device)
        probs = target_probs(logits.index_select(0, rows), [seqs[i].params for i in sampled
                                                            for _ in range(len(drafts[i]) + 1)])
    out, p0 = [], 0
    for i, (seq, draft) in enumerate(zip(seqs, drafts)):
        r0, k = starts[i], len(draft)
        if seq.params.greedy:
            a = 0
            while a < k and greedy_tokens[r0 + a] == draft[a]:
                a += 1
            nxt = greedy_tokens[r0 + a]
        else:
            q = draft_probs[i] if draft_probs is not None else None
            a, nxt = accept(probs[p0:p0 + k + 1], draft, q, seq.generator)
            p0 += k + 1
        tokens = draft[:a] + [nxt]
        lps = logprob_entries(logits[r0:r0 + a + 1], tokens, [seq.params] * (a + 1)) \
            if seq.params.logprobs is not None else [None] * (a + 1)
        out.append(Verified(tokens, lps, a))
    return out


class Speculator:
    """The engine's speculative decoding: which decoding sequences get a draft this step, and how long."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int | None):
        self.proposer = proposer
        self.k = num_tokens
        self.max_batch = max_batch  # back off (no drafts) while more sequences than this are running
        self.stats = SpecStats()

    def draft(self, seqs: list[Sequence], num_new: list[int], running: int, budget: int, bm: BlockManager,
              max_model_len: int) -> dict[Sequence, tuple[list[int], torch.Tensor | None]]:
        """Drafts for the decoding sequences of a scheduled step, appended to their token_ids and counted in
        num_new (in place), with KV blocks allocated for them; {sequence: (draft tokens, their q or None)}."""
        self.collect()
        if self.max_batch is not None and running > self.max_batch:
            return {}
        left = budget - sum(num_new)
        cands, ks = [], []
        for seq, n in zip(seqs, num_new):
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.matcher is not None:
                continue  # a prefill chunk, or a constrained sequence (drafts would bypass its grammar's masks)
            # no draft beyond the context, the request's max_tokens (k drafts emit up to k + 1 tokens) or the budget
            k = min(self.k, max_model_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1, left)
            if k > 0:
                cands.append(seq)
                ks.append(k)
                left -= k
        if not cands:
            return {}
        proposals, qs = self.proposer.propose(cands, ks)
        out = {}
        for i, (seq, draft) in enumerate(zip(cands, proposals)):
            if draft and bm.allocate(seq, seq.num_tokens + len(draft)):
                out[seq] = (draft, qs[i][:len(draft)] if qs is not None else None)
                seq.token_ids.extend(draft)
        for i, seq in enumerate(seqs):
            if seq in out:
                num_new[i] += len(out[seq][0])
        return out

    def collect(self) -> None:
        """Let the proposer free what it holds for finished requests (a draft model's KV blocks)."""
        self.proposer.collect()

    def close(self) -> None:
        self.proposer.close()


def make_speculator(cfg, engine) -> Speculator:
    """The engine's speculator from its EngineConfig (checked by the worker): an n-gram proposer, or a draft model."""
    if cfg.speculative == "ngram":
        proposer = NgramProposer()
    elif Path(cfg.speculative).is_dir():
        proposer = DraftModelProposer(cfg.speculative, engine)
    else:
        raise LlmqError(f"speculative must be 'ngram' or a draft model directory, got {cfg.speculative!r}")
    return Speculator(proposer, cfg.num_speculative_tokens, cfg.speculative_max_batch)
