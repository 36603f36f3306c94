"""The tensor-parallel sharding plan, decided once and read by every writer and by the reference check.

Column-parallel layers (q/k/v, gate, up, lm_head) keep a subset of output rows per rank; row-parallel layers
(o_proj, down) keep the matching input columns and their partial outputs are summed (all-reduce). Everything here
is index arithmetic: for each rank, which source rows/columns land in its slice, with -1 marking a zero pad.

Heads: rank r owns query heads [r*H/tp, (r+1)*H/tp). KV heads are split the same way when there are at least tp
of them, and replicated when there are fewer (tp % kv == 0): rank r then holds kv head r*kv//tp, the one its query
heads attend with. With `pad_heads`, a head count tp does not divide is padded with whole zero GQA groups (zero
q/k/v rows, zero o_proj columns): a padded head attends uniformly over zero values and adds exactly nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...errors import LlmqError
from ...models import ModelSpec

SUPPORTED_TP = (1, 2, 4, 8)


def _kv_fits(kv: int, tp: int) -> bool:
    return kv % tp == 0 or tp % kv == 0


def _heads_fit(heads: int, kv: int, tp: int) -> bool:
    return heads % tp == 0 and _kv_fits(kv, tp)


def _padded_heads(heads: int, kv: int, tp: int) -> tuple[int, int]:
    """Smallest (heads', kv') >= (heads, kv) with the same GQA group size that tp splits."""
    group = heads // kv
    kv_p = kv
    while not _heads_fit(group * kv_p, kv_p, tp):
        kv_p += 1
    return group * kv_p, kv_p


def _rows(units: list[int | None], size: int) -> torch.Tensor:
    """Row indices of consecutive blocks of `size` (a head, say); None gives a block of -1 (zero padding)."""
    parts = [torch.arange(u * size, (u + 1) * size) if u is not None else torch.full((size,), -1) for u in units]
    return torch.cat(parts).long()


@dataclass(frozen=True)
class ShardPlan:
    tp: int
    num_heads: int            # source model
    num_kv_heads: int
    head_dim: int
    padded_heads: int         # what the engine runs (== num_heads unless pad_heads was needed)
    padded_kv_heads: int
    intermediate_size: int
    hidden_size: int
    vocab_size: int
    padded_vocab_size: int    # multiple of tp; lm_head (and a parallel embedding) rows past vocab_size are zero
    parallel_embedding: bool

    @property
    def heads_per_rank(self) -> int:
        return self.padded_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(self.padded_kv_heads // self.tp, 1)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(self.tp // self.padded_kv_heads, 1)

    @property
    def head_padding(self) -> bool:
        return self.padded_heads != self.num_heads

    def q_heads(self, rank: int) -> list[int | None]:
        """Source query head of each of this rank's heads, None for a padding head."""
        start = rank * self.heads_per_rank
        return [h if h < self.num_heads else None for h in range(start, start + self.heads_per_rank)]

    def kv_heads(self, rank: int) -> list[int | None]:
        if self.padded_kv_heads >= self.tp:
            start = rank * self.kv_heads_per_rank
            ids = range(start, start + self.kv_heads_per_rank)
        else:
            ids = [rank * self.padded_kv_heads // self.tp]
        return [k if k < self.num_kv_heads else None for k in ids]

    def q_rows(self, rank: int) -> torch.Tensor:
        """q_proj output rows of this rank; also o_proj's input columns."""
        return _rows(self.q_heads(rank), self.head_dim)

    def kv_rows(self, rank: int) -> torch.Tensor:
        return _rows(self.kv_heads(rank), self.head_dim)

    def mlp_rows(self, rank: int) -> torch.Tensor:
        """gate/up output rows of this rank; also down_proj's input columns."""
        n = self.intermediate_size // self.tp
        return torch.arange(rank * n, (rank + 1) * n)

    def vocab_rows(self, rank: int) -> torch.Tensor:
        n = self.padded_vocab_size // self.tp
        idx = torch.arange(rank * n, (rank + 1) * n)
        return torch.where(idx < self.vocab_size, idx, torch.full_like(idx, -1))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(heads_per_rank=self.heads_per_rank, kv_heads_per_rank=self.kv_heads_per_rank,
                 kv_replicas=self.kv_replicas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ShardPlan":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def make_plan(spec: ModelSpec, tp: int, *, pad_heads: bool = True, parallel_embedding: bool = False) -> ShardPlan:
    """The plan for `spec` on `tp` ranks, or an LlmqError saying which tp values would work."""
    if tp not in SUPPORTED_TP:
        raise LlmqError(f"--tp {tp} is not supported: use one of {', '.join(map(str, SUPPORTED_TP))}")
    heads, kv = spec.num_heads, spec.num_kv_heads
    if heads % kv:
        raise LlmqError(f"model has {heads} attention heads and {kv} KV heads: not a whole GQA group size")
    if _heads_fit(heads, kv, tp):
        padded, kv_padded = heads, kv
    elif pad_heads:
        padded, kv_padded = _padded_heads(heads, kv, tp)
    else:
        ok = [t for t in SUPPORTED_TP if _heads_fit(heads, kv, t)]
        padded, kv_padded = _padded_heads(heads, kv, tp)
        raise LlmqError(f"--tp {tp} does not divide this model's {heads} attention heads / {kv} KV heads "
                        f"(tp values that do: {', '.join(map(str, ok))}); drop --no-pad-heads to add zero heads "
                        f"(exact, {padded} heads / {kv_padded} KV heads)")
    if spec.intermediate_size % tp:
        raise LlmqError(f"--tp {tp} does not divide the MLP width {spec.intermediate_size}")
    padded_vocab = -(-spec.vocab_size // tp) * tp
    return ShardPlan(tp=tp, num_heads=heads, num_kv_heads=kv, head_dim=spec.head_dim, padded_heads=padded,
                     padded_kv_heads=kv_padded, intermediate_size=spec.intermediate_size,
                     hidden_size=spec.hidden_size, vocab_size=spec.vocab_size, padded_vocab_size=padded_vocab,
                     parallel_embedding=parallel_embedding)
