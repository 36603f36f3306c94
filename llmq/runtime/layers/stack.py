"""The Python side of cpu_kernels.cpp's DecoderStack: how each projection of a decoder layer runs in it (a layer's
`fused_spec`: the kernel kind and its tensors), which layers it takes (`fused_layer_args`), and the calls that build
and run a stack of them for a decode-only step."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ... import quant
from ..kv_cache import LayerRecurrent
from .cpu_kernels import _ROUNDING, usable


class Kind(enum.IntEnum):
    """The kernel a DecoderStack runs for one linear: the integers cpu_kernels.cpp's `project` switches on."""

    LOWBIT4 = 0        # lowbit_linear INT4 [codes, s, sz]
    LOWBIT8 = 1        # lowbit_linear INT8 [codes, s, sz]
    INT4PACK = 2       # PyTorch's INT4 kernel [packed, scales_zeros]
    INT8PACK = 3       # PyTorch's INT8 kernel [q, scales]
    LOWBIT4_BF16 = 4   # lowbit_linear_bf16 INT4 [codes, s]
    LOWBIT8_BF16 = 5   # lowbit_linear_bf16 INT8 [codes, s]
    DENSE16 = 6        # dense16_linear [w]
    FP4 = 7            # fp4_linear [codes, s, divisor]
    LOWBIT5_BF16 = 8   # lowbit_linear_bf16 INT5 [codes, s]
    Q4K = 9            # q4k_linear [codes, s, mins]
    FP8 = 10           # fp8_linear [codes, s]
    TABLE_F32 = 11     # table_linear [codes, s, table], each weight rounded to float32
    TABLE_BF16 = 12    # ... to bfloat16
    TABLE_F16 = 13     # ... to float16


@dataclass(frozen=True)
class FusedLinear:
    """How a DecoderStack computes one linear of a decode batch, as the layer's own forward does there (a layer's
    `fused_spec`): the kernel, its weight tensors (at most three), the group size (0: per channel) and the most rows
    the kernel takes at once."""

    kind: Kind
    tensors: tuple[torch.Tensor, ...]
    group: int = 0
    max_rows: int = 1 << 30


def table_spec(codes: torch.Tensor, s: torch.Tensor, table: torch.Tensor, group: int, weight_dtype: torch.dtype
               ) -> FusedLinear:
    """A table_linear layer's decode-batch kernel for a DecoderStack (its `fused_spec`)."""
    return FusedLinear(Kind(Kind.TABLE_F32 + _ROUNDING[weight_dtype]), (codes, s, table), group)


class StackLayer(NamedTuple):
    """One layer of a DecoderStack: its constant arguments (the C++ constructor's, in order) and the most decodes a
    step may hold."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    tensors: list[torch.Tensor]   # per projection part: up to three weight tensors (empty ones fill) and the bias
    kinds: list[int]              # per part: its Kind
    groups: list[int]             # per part: its group size (0: per channel)
    parts: list[int]              # per projection (mixer in, mixer out, gate_up, down): its parts
    mixer: int                    # 0: attention, 1: a Gated DeltaNet
    extras: list[torch.Tensor]    # attention: q / k norms (or empty); Gated DeltaNet: conv, neg_rate, dt_bias, norm
    ints: list[int]               # attention: its output gate (0 / 1), 0; Gated DeltaNet: key heads, key dim
    mixer_eps: float              # the q / k norms' or the gated norm's epsilon
    max_rows: int


def _parts(m) -> list[FusedLinear] | None:
    """A projection's decode-batch kernels: a ConcatLinear's parts', or the layer's own; None where one has none."""
    specs = [getattr(p, "fused_spec", lambda: None)() for p in getattr(m, "parts", [m])]
    return [s for s in specs if s is not None] if all(specs) else None


class _Mixer(NamedTuple):
    """A layer's token mixer in a DecoderStack's terms (StackLayer's fields of the same names)."""

    kind: int
    linears: tuple  # its two projections: in (qkv, or a Gated DeltaNet's mix) and out
    extras: list[torch.Tensor]
    ints: list[int]
    eps: float


def _mixer(layer) -> _Mixer | None:
    """None for a mixer the stack does not compute (Gemma 4's value norms, shared caches and per-layer inputs, sinks,
    a local window)."""
    mix, dtype, empty = layer.mixer, layer.input_norm.weight.dtype, torch.empty(0)
    if layer.ple is not None or layer.layer_scalar is not None:
        return None
    if mix is not None:
        if mix.conv.dtype != dtype or mix.norm.dtype != dtype:
            return None
        return _Mixer(1, (mix.mix, mix.out), [mix.conv, mix.neg_rate, mix.dt_bias, mix.norm],
                      [mix.key_heads, mix.key_dim], mix.eps)
    if layer.sinks is not None or layer.local or layer.v_norm is not None or layer.shares_kv:
        return None
    norms = (layer.q_norm, layer.k_norm)
    if any(n is not None and not usable(n.weight) for n in norms):
        return None
    return _Mixer(0, (layer.qkv, layer.o), [n.weight if n is not None else empty for n in norms] + [empty, empty],
                  [int(layer.attn_gate), 0], layer.q_norm.eps if layer.q_norm is not None else 0.0)


def fused_layer_args(layer) -> StackLayer | None:
    """A models.decoder.DecoderLayer as one layer of a DecoderStack, when its projections are layers with a kernel for
    decode batches (their `fused_spec`), on one rank without row-parallel biases, output norms, GeGLU or a mixture of
    experts (the stack computes none of them); its mixer attention (q / k norms and an output gate included) or a
    Gated DeltaNet; None for any other layer (it runs op by op)."""
    mixer = _mixer(layer)
    if mixer is None or layer.moe is not None or not usable(layer.input_norm.weight) or layer.tp.world > 1 or \
            layer.o_bias is not None or layer.down_bias is not None or layer.attn_out_norm is not None or \
            layer.activation != "silu" or layer.input_norm.eps != layer.post_norm.eps:
        return None
    modules = (*mixer.linears, layer.gate_up, layer.down)
    projections = [_parts(m) for m in modules]
    specs = [s for p in projections if p is not None for s in p]
    if len(projections) != sum(p is not None for p in projections):
        return None
    empty = torch.empty(0)
    parts = [p for m in modules for p in getattr(m, "parts", [m])]
    tensors = [t for s, m in zip(specs, parts)
               for t in (*s.tensors, *[empty] * (3 - len(s.tensors)), m.bias if m.bias is not None else empty)]
    return StackLayer(layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps, tensors,
                      [int(s.kind) for s in specs], [s.group for s in specs],
                      [len(p) for p in projections if p is not None], mixer.kind, mixer.extras, mixer.ints,
                      mixer.eps, min(s.max_rows for s in specs))


def decoder_stack(layers: list[StackLayer]):
    """The C++ DecoderStack (cpu_kernels.cpp) of consecutive layers."""
    return torch.classes.llmq_cpu.DecoderStack([f.input_norm for f in layers], [f.post_norm for f in layers],
                                               layers[0].eps, [t for f in layers for t in f.tensors],
                                               [k for f in layers for k in f.kinds],
                                               [g for f in layers for g in f.groups],
                                               [n for f in layers for n in f.parts], [f.mixer for f in layers],
                                               [t for f in layers for t in f.extras],
                                               [i for f in layers for i in f.ints], [f.mixer_eps for f in layers])


def run_stack(stack, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list, meta, num_heads: int,
              num_kv_heads: int, scale: float) -> torch.Tensor:
    """The residual stream after a DecoderStack's layers for a decode-only step (caches: theirs, in order: an
    attention layer's KV cache, a Gated DeltaNet's recurrent state)."""
    firsts = [c.conv if isinstance(c, LayerRecurrent) else c.k for c in caches]
    seconds = [c.state if isinstance(c, LayerRecurrent) else c.v for c in caches]
    slots = meta.decode_slots if meta.decode_slots is not None else torch.empty(0, dtype=torch.long)
    return stack.forward(x, *rope, firsts, seconds, meta.slot_mapping, meta.decode_blocks,
                         meta.decode_mask.view(meta.num_decode, -1), num_heads, num_kv_heads, scale, quant.EPS, slots)
