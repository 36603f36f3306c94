"""Slicing one linear layer (dense or quantized) by the plan's row/column indices.

Quantized weights are sliced in their unpacked form (`QuantizedWeight.q`, one integer per weight) and packed again
by the writer, so a packed axis is never cut mid-word. Scales and zero points travel with their weights: per-channel
and per-group tensors follow the output rows of a column split; group scales follow the input columns of a row
split group by group, which is only possible when every rank's column range starts and ends on a group boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import LlmqError


@dataclass
class LinearWeights:
    """One linear layer of the source: a dense weight [out, in] or a qformat QuantizedWeight, plus an optional bias."""

    name: str
    weight: torch.Tensor | None = None
    qw: Any = None
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        t = self.weight if self.weight is not None else self.qw.q
        return tuple(t.shape)

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) if self.qw is None else self.qw.dequantize(dtype)


def take(t: torch.Tensor, idx: torch.Tensor, dim: int, fill: float = 0) -> torch.Tensor:
    """t.index_select(dim, idx) where idx == -1 yields `fill`. Works for float8 and integer tensors too."""
    raw = t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    out = raw.index_select(dim, idx.clamp(min=0).to(t.device))
    pad = (idx < 0).to(t.device)
    if pad.any():
        shape = [1] * out.dim()
        shape[dim] = -1
        out = out.masked_fill(pad.view(shape), fill if raw is t else 0)
    return out.view(t.dtype) if raw is not t else out


def group_index(cols: torch.Tensor, group: int, name: str) -> torch.Tensor:
    """Map a column selection to the selection of its quantization groups (-1 for an all-padding group).

    Either the selection is whole groups, or (a rank holding less than a group, as with 64-column groups over
    32-column head slices) it lies inside one group, whose scale the rank then keeps for its partial group."""
    if 0 < cols.numel() < group and bool((cols >= 0).all()):
        first = int(cols[0])
        if torch.equal(cols, torch.arange(first, first + cols.numel())) and (first + cols.numel() - 1) // group == first // group:
            return torch.tensor([first // group])
    if cols.numel() % group:
        raise LlmqError(f"{name}: a rank's {cols.numel()} input columns are not a whole number of "
                        f"{group}-column quantization groups; choose a tp (or group size) that splits on group edges")
    blocks = cols.view(-1, group)
    first = blocks[:, 0]
    expected = first[:, None] + torch.arange(group)
    real = first >= 0
    if not (torch.equal(blocks[real], expected[real]) and bool((first[real] % group == 0).all())
            and bool((blocks[~real] < 0).all())):
        raise LlmqError(f"{name}: the tensor-parallel split cuts through {group}-column quantization groups")
    return torch.where(real, first // group, torch.full_like(first, -1))


def _scale_rows(s: torch.Tensor | None, rows: torch.Tensor, fill: float) -> torch.Tensor | None:
    if s is None or s.numel() == 1:
        return s
    return take(s, rows, 0, fill)


def _scale_cols(s: torch.Tensor | None, cols: torch.Tensor, in_features: int, fill: float, name: str):
    if s is None or s.numel() == 1 or s.dim() == 1 or s.shape[-1] == 1:
        return s  # per-tensor or per-output-channel: every rank keeps it whole
    return take(s, group_index(cols, in_features // s.shape[-1], name), 1, fill)


def split_rows(lw: LinearWeights, rows: torch.Tensor) -> LinearWeights:
    """Column-parallel slice: keep output rows `rows` (with their bias, scales and zero points)."""
    bias = take(lw.bias, rows, 0) if lw.bias is not None else None
    if lw.qw is None:
        return LinearWeights(lw.name, weight=take(lw.weight, rows, 0), bias=bias)
    qw = lw.qw  # padded rows: q 0, zero point 0, scale 1 -> they dequantize to exactly 0
    sliced = dataclasses.replace(qw, q=take(qw.q, rows, 0), scale=_scale_rows(qw.scale, rows, 1.0),
                                 zero_point=_scale_rows(qw.zero_point, rows, 0))
    return LinearWeights(lw.name, qw=sliced, bias=bias)


def split_cols(lw: LinearWeights, cols: torch.Tensor) -> LinearWeights:
    """Row-parallel slice: keep input columns `cols`. The bias stays whole: it is added once after the all-reduce."""
    if lw.qw is None:
        return LinearWeights(lw.name, weight=take(lw.weight, cols, 1), bias=lw.bias)
    qw = lw.qw
    in_features = qw.q.shape[1]
    sliced = dataclasses.replace(
        qw, q=take(qw.q, cols, 1),
        scale=_scale_cols(qw.scale, cols, in_features, 1.0, lw.name),
        zero_point=_scale_cols(qw.zero_point, cols, in_features, 0, lw.name))
    return LinearWeights(lw.name, qw=sliced, bias=lw.bias)



def layer_slices(src, plan, i: int) -> list[dict[str, LinearWeights]]:
    """Every rank's slice of decoder layer i's seven linears, under their Hugging Face module names."""
    from .source import ATTN, MLP, layer_prefix

    p = layer_prefix(i)
    full = {n: src.linear(f"{p}.self_attn.{n}") for n in ATTN} | {n: src.linear(f"{p}.mlp.{n}") for n in MLP}
    out = []
    for r in range(plan.tp):
        q_rows, kv_rows, mlp_rows = plan.q_rows(r), plan.kv_rows(r), plan.mlp_rows(r)
        out.append({
            "q_proj": split_rows(full["q_proj"], q_rows),
            "k_proj": split_rows(full["k_proj"], kv_rows),
            "v_proj": split_rows(full["v_proj"], kv_rows),
            "o_proj": split_cols(full["o_proj"], q_rows),
            "gate_proj": split_rows(full["gate_proj"], mlp_rows),
            "up_proj": split_rows(full["up_proj"], mlp_rows),
            "down_proj": split_cols(full["down_proj"], mlp_rows),
        })
    return out


def kv_scale_slice(scale: torch.Tensor, plan, rank: int) -> torch.Tensor:
    """A per-tensor KV scale goes to every rank whole; a per-KV-head one follows the rank's KV heads."""
    if scale.numel() == 1:
        return scale
    if scale.shape[0] == plan.num_kv_heads:
        heads = torch.tensor([h if h is not None else -1 for h in plan.kv_heads(rank)])
        return take(scale, heads, 0, 1.0)
    if scale.shape[0] == plan.num_kv_heads * plan.head_dim:
        return take(scale, plan.kv_rows(rank), 0, 1.0)
    raise LlmqError(f"KV-cache scale of shape {tuple(scale.shape)} is neither per-tensor, per-KV-head nor "
                    f"per-channel ({plan.num_kv_heads} KV heads x {plan.head_dim})")


def vocab_slice(t: torch.Tensor, plan, rank: int) -> torch.Tensor:
    """Rows of an embedding-shaped tensor for this rank's vocab range, zero past the real vocab."""
    return take(t, plan.vocab_rows(rank), 0)
