"""Attention over the paged KV cache.

The runner describes a step once (AttentionMetadata) and every layer reuses it: new K/V are written to their slots;
single-token queries (decodes) are batched into one SDPA call over their gathered blocks with a length mask;
each multi-token chunk (prefill) attends causally to its sequence's cached prefix plus itself. A prefill with no
cached prefix and an unquantized cache attends to its own fresh K/V directly, which gives identical values. The
runner draws every mask with models.spec.attends, which also applies a model's sliding window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...models.spec import attends
from ..kv_cache import LayerKV
from . import cpu_kernels
from .rotary import apply_rotary


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the step's flat token batch
    q_len: int
    blocks: torch.Tensor | None  # [1, nblocks] when the chunk reads cached K/V, None when it only needs its own
    mask: torch.Tensor | None  # [q_len, ctx] bool (True = attend), None = plain causal over the chunk
    # (blocks None with a mask: the chunk's own fresh K/V under that mask)
    start: int = 0  # the chunk's first position in its sequence
    slot: int = -1  # its sequence's recurrent-state slot (Sequence.state_slot; -1: none)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    num_decode: int = 0  # the first num_decode tokens are single-token queries of distinct sequences
    decode_blocks: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_slots: torch.Tensor | None = None  # [Bd] the decodes' recurrent-state slots (hybrid models)
    # speculation on a hybrid model's recurrent states: before this step, each slot in `settle` goes back to the state
    # after the first `kept` tokens of its journal (kv_cache.Journal), then each slot in `journal` begins one
    settle: dict[int, int] = field(default_factory=dict)
    journal: tuple[int, ...] = ()


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step's metadata for the layers that attend over the last `window` positions only (Gemma 3's local layers,
    beside global ones): the same slots and blocks, every mask also cut to the window (models.spec.attends)."""
    dev = meta.slot_mapping.device
    decode_mask = None
    if meta.num_decode:
        m = meta.decode_mask  # [Bd, 1, 1, S], True up to each decode's own position
        decode_mask = m & attends(m.sum(-1, keepdim=True) - 1, torch.arange(m.shape[-1], device=dev), window)
    prefills = []
    for p in meta.prefills:
        if p.mask is None:  # causal over its own fresh K/V, from position 0
            rows = torch.arange(p.q_len, device=dev)
            mask = attends(rows[:, None], rows[None, :], window) if p.q_len > window else None
        else:  # the window's lower edge only: the mask already says what is visible later (an image's tokens)
            ctx = p.mask.shape[1]
            rows, cols = torch.arange(ctx - p.q_len, ctx, device=dev), torch.arange(ctx, device=dev)
            mask = p.mask & (cols[None, :] > rows[:, None] - window)
        prefills.append(dataclasses.replace(p, mask=mask))
    return dataclasses.replace(meta, decode_mask=decode_mask, prefills=prefills)


def rotate_and_store(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerKV,
                     meta: AttentionMetadata, num_heads: int, num_kv_heads: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v of the fused qkv rows [T, (H + 2 Hkv) D], k and v stored at their cache slots: on CPU with
    a 16/32-bit cache nobody observes, in one pass by llmq's kernel; else apply_rotary, then LayerKV.write."""
    t, d = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    v = qkv[:, (num_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
    rot = rope[0].shape[-1]  # less than d: a partial rotary embedding turns the first `rot` of each head
    if cache.kv_dtype == "auto" and cache.observer is None and cpu_kernels.usable(qkv):
        q, k = cpu_kernels.rope_kv_write(qkv, *rope, cache.k, cache.v, meta.slot_mapping, num_heads, num_kv_heads)
        return q, k, v
    qk = qkv[:, :(num_heads + num_kv_heads) * d].view(t, -1, d)
    qk = apply_rotary(qk, *rope) if rot == d else torch.cat([apply_rotary(qk[..., :rot], *rope), qk[..., rot:]], -1)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    cache.write(meta.slot_mapping, k, v)
    return q, k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: AttentionMetadata,
                    scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (rotated, already in the cache: rotate_and_store) -> [T, H, D]. sinks [H]: each
    head's sink logit, a term of the softmax's denominator with no value (Arch.sinks)."""
    bd = meta.num_decode
    if bd and not meta.prefills:
        return _decode(q, cache, meta, scale, sinks)
    out = torch.empty_like(q)
    if bd:
        out[:bd] = _decode(q[:bd], cache, meta, scale, sinks)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if p.blocks is None:
            ks, vs = k[rows], v[rows]
        else:
            ctx = p.mask.shape[1]
            ks, vs = cache.gather(p.blocks)
            ks, vs = ks[0, :ctx], vs[0, :ctx]
        ks, vs, mask = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), p.mask
        if sinks is not None:
            seen = mask if mask is not None else torch.ones(p.q_len, p.q_len, dtype=torch.bool,
                                                            device=q.device).tril()
            ks, vs, mask = _with_sinks(qs, ks, vs, seen, sinks.view(1, -1, 1, 1))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def _with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's k, v and additive mask for attention with sinks: one more key and value, both zero, whose score is
    each head's sink (the mask's last column, `sinks` shaped to q's head axes), so it takes its share of the softmax
    and adds nothing. q [B, A, R, D]; k / v [B, A', S, D]; seen: bool, broadcast to [B, A, R, S]."""
    b, a, r = q.shape[:3]
    add = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    add = torch.cat([add.expand(b, a, r, k.shape[2]), sinks.to(q.dtype).expand(b, a, r, 1)], -1)
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    return torch.cat([k, zero], 2), torch.cat([v, zero], 2), add


def _decode(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """All decodes at once: on CPU with a 16/32-bit cache llmq's kernel reads the blocks in place, else
    `_decode_sdpa`."""
    bd = meta.num_decode
    if cache.kv_dtype == "auto" and cpu_kernels.usable(q):
        return cpu_kernels.decode_attention(q[:bd], cache.k, cache.v, meta.decode_blocks,
                                            meta.decode_mask.view(bd, -1), scale, sinks)
    return _decode_sdpa(q, cache, meta, scale, sinks)


def _decode_sdpa(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One SDPA call over the gathered blocks; each KV head's query group is laid out as that head's query rows."""
    bd, h, d = meta.num_decode, q.shape[1], q.shape[2]
    kc, vc = cache.gather(meta.decode_blocks)
    hkv = kc.shape[2]
    qs, ks, vs, mask = q[:bd].view(bd, hkv, h // hkv, d), kc.transpose(1, 2), vc.transpose(1, 2), meta.decode_mask
    if sinks is not None:
        ks, vs, mask = _with_sinks(qs, ks, vs, mask, sinks.view(1, hkv, h // hkv, 1))
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return o.reshape(bd, h, d)
