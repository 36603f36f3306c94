"""The Python side of cpu_kernels.cpp's DecoderStack: how each projection of a decoder layer runs in it (a layer's
`fused_spec`: the kernel kind and its tensors), which layers it takes (`fused_layer_args`), and the calls that build
and run a stack of them for a decode-only step."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ... import quant
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
    tensors: list[torch.Tensor]   # per projection: up to three weight tensors (empty ones fill) and the bias
    kinds: list[int]              # per projection: its Kind
    groups: list[int]             # per projection: its group size (0: per channel)
    max_rows: int


def fused_layer_args(layer) -> StackLayer | None:
    """A models.decoder.DecoderLayer as one layer of a DecoderStack, when its four projections are layers with a
    kernel for decode batches (their `fused_spec`), on one rank without row-parallel biases, q/k or output norms,
    GeGLU, a local window or sinks (the stack computes none of them); None for any other layer, a mixture of experts'
    or a Gated DeltaNet's too (they run op by op)."""
    if layer.moe is not None or layer.mixer is not None or layer.sinks is not None:
        return None
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    specs = [getattr(m, "fused_spec", lambda: None)() for m in linears]
    if not all(specs) or not usable(layer.input_norm.weight) or layer.tp.world > 1 or layer.o_bias is not None or \
            layer.down_bias is not None or layer.q_norm is not None or layer.attn_out_norm is not None or \
            layer.activation != "silu" or layer.local or layer.input_norm.eps != layer.post_norm.eps:
        return None
    empty = torch.empty(0)
    tensors = [t for s, m in zip(specs, linears)
               for t in (*s.tensors, *[empty] * (3 - len(s.tensors)), m.bias if m.bias is not None else empty)]
    return StackLayer(layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps, tensors,
                      [int(s.kind) for s in specs], [s.group for s in specs], min(s.max_rows for s in specs))


def decoder_stack(layers: list[StackLayer]):
    """The C++ DecoderStack (cpu_kernels.cpp) of consecutive layers."""
    return torch.classes.llmq_cpu.DecoderStack([f.input_norm for f in layers], [f.post_norm for f in layers],
                                               layers[0].eps, [t for f in layers for t in f.tensors],
                                               [k for f in layers for k in f.kinds],
                                               [g for f in layers for g in f.groups])


def run_stack(stack, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list, meta, num_heads: int,
              num_kv_heads: int, scale: float) -> torch.Tensor:
    """The residual stream after a DecoderStack's layers for a decode-only step (caches: theirs, in order)."""
    return stack.forward(x, *rope, [c.k for c in caches], [c.v for c in caches], meta.slot_mapping,
                         meta.decode_blocks, meta.decode_mask.view(meta.num_decode, -1), num_heads, num_kv_heads,
                         scale, quant.EPS)
