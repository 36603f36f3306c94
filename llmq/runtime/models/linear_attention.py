"""A Gated DeltaNet layer's token mixer (models.arch.base.LinearAttention) over a flat step of many sequences, each
reading and writing its state slot (kv_cache.LayerRecurrent): decodes together, one recurrence step each; prefill
chunks one by one, by the chunked delta rule, from zeros at position 0 or from the slot's state after a chunk."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kv_cache import LayerRecurrent
from ..layers import cpu_kernels, delta_rule
from ..layers.attention import AttentionMetadata
from ..layers.linear import LinearBase


class GatedDeltaNet(nn.Module):
    def __init__(self, mix: LinearBase, out: LinearBase, conv: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, eps: float, key_heads: int, value_heads: int,
                 key_dim: int, value_dim: int):
        """mix: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a fused (column-parallel rows in that order); conv
        [channels, 1, kernel] as stored; norm: the gated RMSNorm's weight [value_dim]."""
        super().__init__()
        self.mix, self.out = mix, out
        self.register_buffer("conv", conv[:, 0], persistent=False)           # [channels, kernel]
        self.register_buffer("neg_rate", -A_log.float().exp(), persistent=False)
        self.register_buffer("dt_bias", dt_bias.float(), persistent=False)
        self.register_buffer("norm", norm, persistent=False)
        self.eps = eps
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.key_size, self.value_size = key_heads * key_dim, value_heads * value_dim

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (L2-normalized, scaled by key_dim^-1/2), k (L2-normalized), both repeated over their value heads, and v,
        in float32, of convolved rows [T, channels]."""
        t = mixed.shape[0]
        q, k, v = mixed.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        group = self.value_heads // self.key_heads

        def unit(x: torch.Tensor) -> torch.Tensor:
            x = x.view(t, self.key_heads, self.key_dim)
            return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1)

        return unit(q) * self.key_dim ** -0.5, unit(k), v.view(t, self.value_heads, self.value_dim)

    def forward(self, x: torch.Tensor, cache: LayerRecurrent, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.mix(x).split([self.conv.shape[0], self.value_size, self.value_heads, self.value_heads],
                                         dim=-1)
        beta = b.float().sigmoid()
        g = self.neg_rate * F.softplus(a.float() + self.dt_bias)
        width = self.conv.shape[1]
        mixed = torch.empty_like(qkv)
        o = torch.empty(t, self.value_heads, self.value_dim, dtype=torch.float32, device=x.device)
        bd = meta.num_decode
        if bd:
            slots = meta.decode_slots
            window = torch.cat([cache.conv[slots], qkv[:bd, :, None]], dim=-1)     # [Bd, channels, kernel]
            cache.conv[slots] = window[..., 1:]
            mixed[:bd] = F.silu((window * self.conv).sum(-1))
            if cpu_kernels.usable(cache.state) and cache.state.is_contiguous():   # on the slots' states in place
                o[:bd] = cpu_kernels.delta_rule_step(cache.state, slots, *self._heads(mixed[:bd]), g[:bd], beta[:bd])
            else:
                state = cache.state[slots]
                o[:bd] = delta_rule.step(state, *self._heads(mixed[:bd]), g[:bd], beta[:bd])
                cache.state[slots] = state
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            fresh = p.start == 0
            history = torch.zeros_like(cache.conv[p.slot]) if fresh else cache.conv[p.slot]
            inputs = torch.cat([history, qkv[rows].t()], dim=-1)                    # [channels, kernel - 1 + n]
            cache.conv[p.slot] = inputs[:, -(width - 1):]
            mixed[rows] = F.silu(F.conv1d(inputs[None], self.conv[:, None], groups=inputs.shape[0])[0].t())
            state = torch.zeros_like(cache.state[p.slot]) if fresh else cache.state[p.slot].clone()
            o[rows] = delta_rule.chunked(state, *self._heads(mixed[rows]), g[rows], beta[rows])
            cache.state[p.slot] = state
        # the gated RMSNorm over each value head, in transformers' order of roundings
        o = o.to(x.dtype).float()
        o = self.norm * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        o = (o * F.silu(z.float().view(t, self.value_heads, self.value_dim))).to(x.dtype)
        return self.out(o.reshape(t, self.value_size))
