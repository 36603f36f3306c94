"""What a Gemma 4 decoder layer reads besides the residual stream, carried in it through the layer-by-layer pass.

The pass runs transformers' layers one at a time over whole streams (calibration, the probe's float and quantized
ones), each stream a tensor. A Gemma 4 layer also takes its per-layer input (a function of the window's tokens) and,
in its last layers, the keys and values an earlier layer computed on the same stream (transformers hands them over
in a dict during one forward). So a stream is widened: the hidden state, then every layer's per-layer input, then
each producing layer's keys and values, zero until that layer has run; `adapt` makes a layer read its parts and write
its keys and values, and `narrow` gives the hidden state back. Other families' streams are the hidden state alone
(StreamLayout.of is None)."""

from __future__ import annotations

import torch
from torch import nn

from ...models import ModelSpec


class StreamLayout:
    def __init__(self, spec: ModelSpec):
        self.hidden, self.layers, self.ple = spec.hidden_size, spec.num_layers, spec.ple_dim
        self.spec = spec
        off = self.hidden + self.layers * self.ple
        self.kv: dict[int, tuple[int, int]] = {}   # producing layer -> (offset of its keys, keys' width)
        for p in sorted({spec.kv_source[i] for i in range(spec.num_layers) if spec.shares_kv(i)}):
            width = spec.kv_heads_of(p) * spec.head_dim_of(p)
            self.kv[p] = (off, width)
            off += 2 * width
        self.width = off

    @classmethod
    def of(cls, spec: ModelSpec) -> StreamLayout | None:
        return cls(spec) if spec.ple_dim or spec.kv_source else None

    def widen(self, hidden: torch.Tensor, per_layer: list[torch.Tensor]) -> torch.Tensor:
        """The stream entering layer 0: the hidden state [B, T, H], the layers' per-layer inputs ([B, T, size]
        each, as the model hands them to its layers), room for the shared keys and values."""
        rest = self.width - self.hidden - sum(p.shape[-1] for p in per_layer)
        return torch.cat([hidden, *(p.to(hidden.dtype) for p in per_layer),
                          hidden.new_zeros(*hidden.shape[:-1], rest)], dim=-1)

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :self.hidden]

    def _kv(self, x: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        off, width = self.kv[p]
        d = self.spec.head_dim_of(p)
        return tuple(x[..., o:o + width].unflatten(-1, (-1, d)).transpose(1, 2) for o in (off, off + width))

    def adapt(self, layer: nn.Module, i: int) -> nn.Module:
        """Make transformers' layer i take and give widened streams (its own forward, on its own parts)."""
        from transformers.cache_utils import KVSharingDict

        forward, kind = layer.forward, str(layer.get_submodule(self.spec.arch.attention).layer_type)
        reads = self.spec.kv_source[i] if self.spec.shares_kv(i) else None
        h, ple = self.hidden, self.ple

        def stream_forward(x: torch.Tensor, **kw) -> torch.Tensor:
            shared = KVSharingDict({kind: self._kv(x, reads)} if reads is not None else {})
            mine = x[..., h + i * ple:h + (i + 1) * ple] if ple else None
            out = forward(x[..., :h], mine, shared_kv_states=shared, **kw)
            rest = x[..., h:]
            if i in self.kv:   # the keys and values it stored for the layers after it
                off, width = self.kv[i]
                k, v = (t.transpose(1, 2).flatten(-2) for t in shared[kind])
                rest = torch.cat([rest[..., :off - h], k.to(x.dtype), v.to(x.dtype), rest[..., off - h + 2 * width:]],
                                 dim=-1)
            return torch.cat([out, rest], dim=-1)

        layer.forward = stream_forward
        return layer
