"""Turning a checkpoint directory into this rank's modules: dense or quantized linears, norms, embedding, KV scales.

Two sources: a Hugging Face-style directory (a model or quantized artifact; sliced here when tp > 1) or one
`rank{r}/` directory of a `build --target llmq` engine (already sliced by the build stage). Quantized weights are
read only through llmq.models.qformat. q/k/v and gate/up are fused into one linear each when their packings allow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LlmqError
from ..models import ModelSpec
from ..models.reader import CheckpointReader
from .layers.linear import (DenseLinear, FP8Linear, Int4WeightOnlyLinear, Int8WeightOnlyLinear, LinearBase,
                            W8A8Linear)


@dataclass
class Part:
    """One source linear: a dense weight [out, in] or a qformat QuantizedWeight, plus an optional bias."""

    weight: torch.Tensor | None = None
    qw: Any = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return (self.weight if self.weight is not None else self.qw.q).shape[0]


class Checkpoint(CheckpointReader):
    """The checkpoint this rank loads; linears come as Parts, which the loader slices and fuses."""

    def linear(self, name: str) -> Part:
        weight, qw, bias = self.linear_tensors(name)
        return Part(weight=weight, qw=qw, bias=bias)


# -- slicing an unsharded checkpoint for one rank ------------------------------------------------------------------
def _take_rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """Rows `rows` of t (-1 rows are zero); per-tensor (1-element) tensors stay whole."""
    if t is None or t.numel() == 1:
        return t
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = raw.index_select(0, rows.clamp(min=0))
    pad = rows < 0
    if pad.any():
        out[pad] = 0
    return out.view(t.dtype) if raw is not t else out


def split_rows(p: Part, rows: torch.Tensor) -> Part:
    """Column-parallel slice: the output rows `rows` with their bias, scales and zero points."""
    bias = _take_rows(p.bias, rows)
    if p.qw is None:
        return Part(weight=_take_rows(p.weight, rows), bias=bias)
    qw = p.qw
    scale = _take_rows(qw.scale, rows)
    if scale is not None and scale.numel() > 1 and bool((rows < 0).any()):
        scale[rows < 0] = 1
    return Part(qw=dataclasses.replace(qw, q=_take_rows(qw.q, rows), scale=scale,
                                       zero_point=_take_rows(qw.zero_point, rows)), bias=bias)


def split_cols(p: Part, start: int, stop: int) -> Part:
    """Row-parallel slice: input columns [start, stop); the bias is kept whole (added after the all-reduce)."""
    if p.qw is None:
        return Part(weight=p.weight[:, start:stop], bias=p.bias)
    qw = p.qw
    k = qw.q.shape[1]

    def cols(t):
        if t is None or t.numel() == 1 or t.dim() == 1 or t.shape[-1] == 1:
            return t
        group = k // t.shape[-1]
        if start % group or stop % group:
            raise LlmqError(f"tensor parallelism would cut {group}-column quantization groups; use another tp")
        return t[:, start // group:stop // group]

    return Part(qw=dataclasses.replace(qw, q=qw.q[:, start:stop], scale=cols(qw.scale),
                                       zero_point=cols(qw.zero_point)), bias=p.bias)


@dataclass(frozen=True)
class RankLayout:
    """Which heads / MLP columns / vocabulary rows this rank holds when the runtime slices a checkpoint itself."""

    tp: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def make(cls, spec: ModelSpec, tp: int, rank: int) -> "RankLayout":
        h, kv = spec.num_heads, spec.num_kv_heads
        if h % tp or not (kv % tp == 0 or tp % kv == 0) or spec.intermediate_size % tp:
            raise LlmqError(f"tp={tp} does not divide this model's {h} heads / {kv} KV heads / MLP width "
                            f"{spec.intermediate_size}; build an engine with `llmq build --tp {tp}` (it pads the heads)")
        return cls(tp, rank, h, kv, spec.head_dim, spec.intermediate_size, spec.vocab_size)

    @property
    def heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(self.num_kv_heads // self.tp, 1)

    def q_rows(self) -> torch.Tensor:
        n = self.heads * self.head_dim
        return torch.arange(self.rank * n, (self.rank + 1) * n)

    def kv_head_ids(self) -> torch.Tensor:
        if self.num_kv_heads >= self.tp:
            return torch.arange(self.rank * self.kv_heads, (self.rank + 1) * self.kv_heads)
        return torch.tensor([self.rank * self.num_kv_heads // self.tp])

    def kv_rows(self) -> torch.Tensor:
        return (self.kv_head_ids()[:, None] * self.head_dim + torch.arange(self.head_dim)).flatten()

    def mlp_cols(self) -> tuple[int, int]:
        n = self.intermediate_size // self.tp
        return self.rank * n, (self.rank + 1) * n

    def vocab_rows(self) -> torch.Tensor:
        n = -(-self.vocab_size // self.tp)
        idx = torch.arange(self.rank * n, (self.rank + 1) * n)
        return torch.where(idx < self.vocab_size, idx, torch.full_like(idx, -1))


# -- building layers -----------------------------------------------------------------------------------------------
def _activation_quant(qw) -> bool:
    return bool(getattr(qw, "input_scale", None) is not None or getattr(qw, "dynamic", False))


def quantized_linear(qw, bias: torch.Tensor | None, dtype: torch.dtype, device) -> LinearBase:
    """The runtime layer for one qformat QuantizedWeight, on `device`."""
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    q, scale, zero, bias = to(qw.q), to(qw.scale), to(qw.zero_point), to(bias)
    inp = to(getattr(qw, "input_scale", None))
    if q.dtype == torch.float8_e4m3fn:
        return FP8Linear(q, scale, inp, _activation_quant(qw), bias, dtype)
    if _activation_quant(qw):
        if qw.bits != 8:
            raise LlmqError(f"W{qw.bits}A8 is not supported by the runtime (only W8A8 integer)")
        return W8A8Linear(q, scale, inp, bias, dtype)
    if qw.bits == 8:
        return Int8WeightOnlyLinear(q, scale, zero, bias, dtype)
    if qw.bits == 4:
        return Int4WeightOnlyLinear(q, scale, zero, bias, dtype)
    raise LlmqError(f"{qw.bits}-bit weights ({qw.scheme}) are not supported by the runtime")


def _fusable(parts: list[Part]) -> bool:
    if all(p.qw is None for p in parts):
        return True
    if any(p.qw is None for p in parts):
        return False
    a = parts[0].qw
    def sig(qw):
        s = qw.scale
        return (qw.scheme, qw.bits, qw.q.dtype, s.numel() == 1, s.shape[-1] if s.dim() > 1 else 1,
                qw.zero_point is None, getattr(qw, "dynamic", False))
    if any(sig(p.qw) != sig(a) for p in parts):
        return False
    if a.scale.numel() == 1 and any(not torch.equal(p.qw.scale, a.scale) for p in parts):
        return False  # one per-tensor scale each: cannot share a single scale
    ins = [getattr(p.qw, "input_scale", None) for p in parts]
    return all(i is None for i in ins) or all(i is not None and torch.equal(i, ins[0]) for i in ins)


def _cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if ts[0] is None or ts[0].numel() == 1:
        return ts[0]
    return torch.cat(ts, dim=0)


class ConcatLinear(LinearBase):
    """Several column-parallel linears read as one (when their packings cannot be concatenated)."""

    def __init__(self, parts: list[LinearBase]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.bias = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def build_linear(parts: list[Part], dtype: torch.dtype, device) -> LinearBase:
    if not _fusable(parts):
        return ConcatLinear([build_linear([p], dtype, device) for p in parts])
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]).to(dtype)
    if parts[0].qw is None:
        w = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
        return DenseLinear(w.to(device=device, dtype=dtype), bias.to(device) if bias is not None else None)
    qws = [p.qw for p in parts]
    fused = qws[0] if len(qws) == 1 else dataclasses.replace(
        qws[0], q=torch.cat([q.q for q in qws]), scale=_cat([q.scale for q in qws]),
        zero_point=_cat([q.zero_point for q in qws]))
    return quantized_linear(fused, bias, dtype, device)
