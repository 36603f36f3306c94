"""A Gated DeltaNet layer's token mixer (models.arch.base.LinearAttention) over a flat step of many sequences, each
reading and writing its state slot (kv_cache.LayerRecurrent): decodes together, one recurrence step each; prefill
chunks one by one, by the chunked delta rule, from zeros at position 0 or from the slot's state after a chunk.

Speculative decoding moves a state past tokens that may be rejected (a verified draft, a draft model's own drafts):
such a slot keeps a journal (kv_cache.Journal) of its state before them and of their inputs, and rolling back restores
that state and replays the kept tokens' recurrence only (no projection is recomputed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kv_cache import Journal, LayerRecurrent
from ..layers import cpu_kernels, delta_rule
from ..layers.attention import AttentionMetadata
from ..layers.linear import LinearBase


class GatedDeltaNet(nn.Module):
    conv: torch.Tensor        # [channels, kernel]
    neg_rate: torch.Tensor    # -e^A_log [value heads], float32
    dt_bias: torch.Tensor     # [value heads], float32
    norm: torch.Tensor        # [value dim]

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

    def _chunk(self, cache: LayerRecurrent, slot: int, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               fresh: bool) -> torch.Tensor:
        """n tokens of one sequence (its rows before the convolution, decays, rates) from the slot's state, or from
        zeros where `fresh`: the slot's new state, and the outputs [n, value heads, value dim]. On CPU by
        cpu_kernels.delta_prefill (token by token, in place), else by the chunked rule."""
        if cpu_kernels.usable(cache.state) and cache.state.is_contiguous() and cache.conv.is_contiguous():
            if fresh:
                cache.conv[slot].zero_()
                cache.state[slot].zero_()
            return cpu_kernels.delta_prefill(qkv, g, beta, cache.conv, cache.state, slot, self.conv, self.key_heads,
                                             self.key_dim)
        history = torch.zeros_like(cache.conv[slot]) if fresh else cache.conv[slot]
        inputs = torch.cat([history, qkv.t()], dim=-1)                               # [channels, kernel - 1 + n]
        cache.conv[slot] = inputs[:, -(self.conv.shape[1] - 1):]
        mixed = F.silu(F.conv1d(inputs[None], self.conv[:, None], groups=inputs.shape[0])[0].t())
        state = torch.zeros_like(cache.state[slot]) if fresh else cache.state[slot].clone()
        o = delta_rule.chunked(state, *self._heads(mixed), g, beta)
        cache.state[slot] = state
        return o

    def _journals(self, cache: LayerRecurrent, meta: AttentionMetadata) -> None:
        """Before the step: roll the settled slots back to their kept tokens, forget the journals of slots a new
        sequence takes (a prefill from position 0), begin the step's journals."""
        for slot, kept in meta.settle.items():
            j = cache.journals.pop(slot, None)
            if j is None or kept == len(j):
                continue
            cache.conv[slot], cache.state[slot] = j.conv, j.state
            if kept:
                self._chunk(cache, slot, *(torch.cat(t)[:kept] for t in (j.qkv, j.g, j.beta)), fresh=False)
        for p in meta.prefills:
            if p.start == 0:
                cache.journals.pop(p.slot, None)
        for slot in meta.journal:
            cache.journals[slot] = Journal(cache.conv[slot].clone(), cache.state[slot].clone())

    def _record(self, cache: LayerRecurrent, slot: int, rows: slice, qkv: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> None:
        """Add the step's rows of a journaled slot to its journal."""
        j = cache.journals.get(slot)
        if j is not None:
            j.qkv.append(qkv[rows].clone())
            j.g.append(g[rows])
            j.beta.append(beta[rows])

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm over each value head of o [T, value heads, value dim] (float32), times SiLU(z), in
        transformers' order of roundings -> [T, value size] in z's dtype."""
        t, dtype = o.shape[0], z.dtype
        o = o.to(dtype).float()
        o = self.norm * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (o * F.silu(z.float().view(t, self.value_heads, self.value_dim))).to(dtype).reshape(t, -1)

    def _decodes(self, mixed: torch.Tensor, cache: LayerRecurrent, slots: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
        """The decode rows' outputs [Bd, value size] from their mix rows: one recurrence step each on the slots'
        states (in place), by cpu_kernels.gated_delta_decode where it serves (from the mix rows alone), else PyTorch's
        operations (with the rows' decays g and rates beta)."""
        if cpu_kernels.usable(cache.state) and cache.state.is_contiguous() and cache.conv.is_contiguous():
            return cpu_kernels.gated_delta_decode(mixed, cache.conv, cache.state, slots, self.conv, self.neg_rate,
                                                  self.dt_bias, self.norm, self.eps, self.key_heads, self.key_dim)
        qkv, z = mixed[:, :self.conv.shape[0]], mixed[:, self.conv.shape[0]:self.conv.shape[0] + self.value_size]
        window = torch.cat([cache.conv[slots], qkv[:, :, None]], dim=-1)     # [Bd, channels, kernel]
        cache.conv[slots] = window[..., 1:]
        state = cache.state[slots]
        o = delta_rule.step(state, *self._heads(F.silu((window * self.conv).sum(-1))), g, beta)
        cache.state[slots] = state
        return self._gated_norm(o, z)

    def forward(self, x: torch.Tensor, cache: LayerRecurrent, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        mixed = self.mix(x)
        qkv, z, b, a = mixed.split([self.conv.shape[0], self.value_size, self.value_heads, self.value_heads], dim=-1)
        beta = b.float().sigmoid()
        g = self.neg_rate * F.softplus(a.float() + self.dt_bias)
        if meta.settle or meta.journal or cache.journals:
            self._journals(cache, meta)
        out = torch.empty(t, self.value_size, dtype=x.dtype, device=x.device)
        bd = meta.num_decode
        if bd:
            slots = meta.decode_slots
            out[:bd] = self._decodes(mixed[:bd], cache, slots, g[:bd], beta[:bd])
            if cache.journals:
                for i, slot in enumerate(slots.tolist()):
                    self._record(cache, slot, slice(i, i + 1), qkv, g, beta)
        if meta.prefills:
            o = torch.empty(t - bd, self.value_heads, self.value_dim, dtype=torch.float32, device=x.device)
            for p in meta.prefills:
                rows = slice(p.q_start, p.q_start + p.q_len)
                self._record(cache, p.slot, rows, qkv, g, beta)
                o[p.q_start - bd:p.q_start - bd + p.q_len] = self._chunk(cache, p.slot, qkv[rows], g[rows], beta[rows],
                                                                         fresh=p.start == 0)
            out[bd:] = self._gated_norm(o, z[bd:])
        return self.out(out)
