"""Turning one rank's linears (LinearWeights, sliced by llmq.models.sharding when needed) into runtime layers.

Quantized weights are read only through llmq.models.qformat (compressed-tensors) and llmq.models.bnbformat
(bitsandbytes). q/k/v and gate/up are fused into one linear each when their packings allow.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import LlmqError
from ..models import bnbformat, qformat
from ..models.linear_weights import LinearWeights
from .layers.act_quant import FP8Linear, W8A8Linear
from .layers.linear import DenseLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear, LinearBase


def _activation_quant(qw) -> bool:
    return bool(getattr(qw, "input_scale", None) is not None or getattr(qw, "dynamic", False))


def quantized_linear(qw, bias: torch.Tensor | None, dtype: torch.dtype, device, int8_activations: bool = False
                     ) -> LinearBase:
    """The runtime layer for one quantized weight (a qformat QuantizedWeight or a bnbformat weight), on `device`.
    int8_activations: INT4 / INT8 weight-only layers run llmq's int8-activation CPU kernels where they can
    (EngineConfig.int8_activations)."""
    if isinstance(qw, (bnbformat.NF4Weight, bnbformat.Int8Weight)):
        from .layers.bnb import LLMInt8Linear, NF4Linear

        return (NF4Linear if isinstance(qw, bnbformat.NF4Weight) else LLMInt8Linear)(qw, bias, dtype, device)
    if isinstance(qw, qformat.GGMLWeight):
        from .layers.kquant import IQ4Linear, Q4KLinear

        return (Q4KLinear if isinstance(qw, qformat.Q4KWeight) else IQ4Linear)(qw, bias, dtype, device)
    if getattr(qw, "fp4", None):
        from .layers.fp4 import FP4Linear

        return FP4Linear(qw, bias, dtype, device)
    if getattr(qw, "block", None):
        from .layers.fp8_block import BlockFP8Linear

        return BlockFP8Linear(qw, bias, dtype, device)
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    q, scale, zero, bias = to(qw.q), to(qw.scale), to(qw.zero_point), to(bias)
    inp = to(getattr(qw, "input_scale", None))
    if q.dtype == torch.float8_e4m3fn:
        return FP8Linear(q, scale, inp, _activation_quant(qw), bias, dtype)
    if _activation_quant(qw):
        if qw.bits != 8:
            raise LlmqError(f"W{qw.bits}A8 is not supported by the runtime (only W8A8 integer)")
        return W8A8Linear(q, scale, inp, bias, dtype)
    if qw.bits in (5, 8):   # 5-bit integers (GGUF's Q5_0 / Q5_1): INT8's layer, packed in 5 bits where it can
        return Int8WeightOnlyLinear(q, scale, zero, bias, dtype, int8_activations, qw.bits)
    if qw.bits == 4:
        return Int4WeightOnlyLinear(q, scale, zero, bias, dtype, int8_activations)
    raise LlmqError(f"{qw.bits}-bit weights ({qw.scheme}) are not supported by the runtime")


def _fusable(parts: list[LinearWeights]) -> bool:
    if all(p.qw is None for p in parts):
        return True
    if any(p.qw is None for p in parts):
        return False
    a = parts[0].qw
    if any(type(p.qw) is not type(a) for p in parts):
        return False
    if isinstance(a, bnbformat.NF4Weight):
        return bnbformat.NF4Weight.cat([p.qw for p in parts]) is not None
    if isinstance(a, (bnbformat.Int8Weight, qformat.GGMLWeight)):
        return True

    def sig(qw):
        s = qw.scale
        return (qw.scheme, qw.bits, qw.q.dtype, s.numel() == 1, s.shape[-1] if s.dim() > 1 else 1,
                qw.zero_point is None, getattr(qw, "dynamic", False))
    if any(sig(p.qw) != sig(a) for p in parts):
        return False
    if a.block and any(p.qw.q.shape[0] % a.block[0] for p in parts[:-1]):
        return False  # block FP8: a part that ends inside a row block shares no scale row with the next
    if a.scale.numel() == 1 and not a.block and any(not torch.equal(p.qw.scale, a.scale) for p in parts):
        return False  # one per-tensor scale each: cannot share a single scale

    def agree(field: str) -> bool:  # none of the parts has one, or all have the same
        ts = [getattr(p.qw, field, None) for p in parts]
        return all(t is None for t in ts) or all(t is not None and torch.equal(t, ts[0]) for t in ts)

    # NVFP4's global scales (weights', W4A4 inputs'), static activation scales: one for the fused matmul, or none
    return agree("global_scale") and agree("input_global_scale") and agree("input_scale")


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


def build_linear(parts: list[LinearWeights], dtype: torch.dtype, device, int8_activations: bool = False
                 ) -> LinearBase:
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]).to(dtype)
    if not _fusable(parts):
        from .layers.fp8_block import BlockFP8Linear

        layers = [build_linear([p], dtype, device, int8_activations) for p in parts]
        return BlockFP8Linear.joined(layers, bias) or ConcatLinear(layers)
    if parts[0].qw is None:
        w = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
        return DenseLinear(w.to(device), bias.to(device) if bias is not None else None, dtype)
    qws = [p.qw for p in parts]
    if len(qws) > 1 and isinstance(qws[0], (bnbformat.NF4Weight, bnbformat.Int8Weight, qformat.GGMLWeight)):
        return quantized_linear(type(qws[0]).cat(qws), bias, dtype, device, int8_activations)
    fused = qws[0] if len(qws) == 1 else dataclasses.replace(
        qws[0], q=torch.cat([q.q for q in qws]),
        scale=torch.cat([q.scale for q in qws]) if qws[0].block else _cat([q.scale for q in qws]),
        zero_point=_cat([q.zero_point for q in qws]))
    return quantized_linear(fused, bias, dtype, device, int8_activations)
