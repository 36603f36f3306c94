"""Batched log-likelihood scoring through the bundled runtime's paged KV cache, with prefix reuse.

Scoring is what multiple-choice and perplexity tasks spend nearly all their time on. Items that share a prefix (the
same few-shot prompt, the same question with different answers) reuse the KV blocks of that prefix through the
engine's own hash-chained prefix cache, so a 5-shot prompt is computed once, not once per choice. To make that
happen an item is admitted to a step only when no item still in flight is computing blocks it could reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch

from ..errors import LlmqError
from ..runtime.model_runner import prepare_step
from ..runtime.sampling import SamplingParams
from ..runtime.sequence import Sequence


@dataclass
class ScoreItem:
    """Score tokens[start:] given everything before it (start >= 1)."""

    tokens: list[int]
    start: int


@dataclass
class Score:
    logprob: float  # sum of log p(tokens[i] | tokens[:i]) over i >= start
    greedy: bool  # every scored token was the argmax


def _block_keys(tokens: list[int], n_blocks: int, bs: int) -> list[int]:
    """Hash chain of the first n_blocks full blocks (identifies shareable prefixes, like the block manager does)."""
    keys, parent = [], None
    for i in range(n_blocks):
        parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        keys.append(parent)
    return keys


class _Active:
    __slots__ = ("idx", "item", "seq", "keys", "lp", "greedy")

    def __init__(self, idx: int, item: ScoreItem, seq: Sequence, keys: list[int]):
        self.idx, self.item, self.seq, self.keys = idx, item, seq, keys
        self.lp = 0.0
        self.greedy = True


def score_paged(engine, items: Seq[ScoreItem], progress: Callable[[int], None] | None = None,
                stats: dict | None = None) -> list[Score]:
    """Log-likelihoods of many items, several sequences per engine step (chunked to the engine's token budget).

    stats, when given, accumulates "computed_tokens" and "reused_tokens" (served from the prefix cache).
    """
    stats = stats if stats is not None else {}
    stats.setdefault("computed_tokens", 0)
    stats.setdefault("reused_tokens", 0)
    if engine.has_unfinished():
        raise LlmqError("the engine is serving requests; scoring needs it to itself")
    bm, bs = engine.block_manager, engine.block_size
    budget, max_seqs = engine.config.max_num_batched_tokens, engine.max_num_seqs
    for it in items:
        if not 1 <= it.start < len(it.tokens) or len(it.tokens) > engine.max_model_len:
            raise LlmqError(f"cannot score an item of {len(it.tokens)} tokens from {it.start} "
                            f"(context {engine.max_model_len})")
    # sorted by tokens: items sharing a prefix are neighbours, so the lookahead window finds them together
    order = sorted(range(len(items)), key=lambda i: items[i].tokens)
    pending = list(order)
    results: list[Score | None] = [None] * len(items)
    active: list[_Active] = []
    direct = engine.kv_cache_dtype == "auto"
    lookahead = 4 * max_seqs
    with torch.inference_mode():
        while pending or active:
            computing = {k for a in active for k in a.keys[a.seq.num_computed_tokens // bs:]}
            kept = []
            for pos, i in enumerate(pending):
                if pos >= lookahead or len(active) >= max_seqs:
                    kept.extend(pending[pos:])
                    break
                it = items[i]
                shareable = (it.start - 1) // bs
                keys = _block_keys(it.tokens, shareable, bs)
                seq = Sequence(f"score-{i}", it.tokens[:it.start], SamplingParams(max_tokens=1, temperature=0))
                matched = bm.match_prefix(seq) // bs
                if any(k in computing for k in keys[matched:]) or not bm.allocate(seq, len(it.tokens)):
                    bm.release(seq)  # wait for the item computing these blocks (or for free blocks)
                    kept.append(i)
                    continue
                seq.token_ids = list(it.tokens)
                stats["reused_tokens"] += matched * bs
                stats["computed_tokens"] += len(it.tokens) - matched * bs
                a = _Active(i, it, seq, _block_keys(it.tokens, len(it.tokens) // bs, bs))
                active.append(a)
                computing.update(a.keys[matched:])
            pending = kept
            if not active:
                raise LlmqError("the KV cache cannot hold even one scoring item; lower the context or raise its memory")
            # one step: single-token chunks first (prepare_step's rule), then the rest, within the token budget
            chunks, left = [], budget
            for a in active:
                if left == 0:
                    break
                n = min(len(a.item.tokens) - a.seq.num_computed_tokens, left)
                chunks.append((a, n))
                left -= n
            chunks.sort(key=lambda c: c[1] != 1)
            step = prepare_step([a.seq for a, _ in chunks], [n for _, n in chunks], bs, fresh_prefill_direct=direct,
                                all_logits=True, window=engine.spec.sliding_window)
            wanted, targets, owners, q0 = [], [], [], 0
            for a, n in chunks:
                st, toks = a.seq.num_computed_tokens, a.item.tokens
                lo, hi = max(st, a.item.start - 1), min(st + n, len(toks) - 1)
                for p in range(lo, hi):
                    wanted.append(q0 + p - st)
                    targets.append(toks[p + 1])
                    owners.append(a)
                q0 += n
            step.logits_indices = torch.tensor(wanted, dtype=torch.long)
            logits = engine._forward(step) if wanted else engine._forward(_with_one_logit(step))
            if wanted:
                lsm = logits.float().log_softmax(-1)
                tgt = torch.tensor(targets, device=lsm.device)
                tok_lp = lsm.gather(1, tgt[:, None])[:, 0].tolist()
                hit = (lsm.argmax(-1) == tgt).tolist()
                for a, lp, h in zip(owners, tok_lp, hit):
                    a.lp += lp
                    a.greedy &= bool(h)
            done = []
            for a, n in chunks:
                a.seq.num_computed_tokens += n
                bm.commit(a.seq)
                if a.seq.num_computed_tokens == len(a.item.tokens):
                    done.append(a)
            for a in done:
                bm.release(a.seq)
                active.remove(a)
                results[a.idx] = Score(a.lp, a.greedy)
            if done and progress is not None:
                progress(len(done))
    return results  # type: ignore[return-value]


def _with_one_logit(step):
    """A step whose chunks predict nothing scored still has to run (its KV is needed): ask for one row."""
    step.logits_indices = torch.zeros(1, dtype=torch.long)
    return step
