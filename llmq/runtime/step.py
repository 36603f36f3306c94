"""One engine step as tensors: the flat token batch of many sequences (decode tokens first, then prefill chunks)
and the metadata attention needs (slots to write, block tables to read, masks), computed once per step on the CPU,
not per layer; a tensor-parallel step is broadcast to every rank as it is."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ..models.spec import attends
from .layers.attention import AttentionMetadata, PrefillChunk


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # image embeddings that replace the embedding rows of their placeholder tokens: (flat rows, [rows, hidden])
    images: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device) -> "StepInput":
        if self.input_ids.device == torch.device(device):
            return self
        mv = lambda t: t.to(device) if t is not None else None  # noqa: E731
        m = self.meta
        meta = dataclasses.replace(m, slot_mapping=mv(m.slot_mapping), decode_blocks=mv(m.decode_blocks),
                                   decode_mask=mv(m.decode_mask), decode_slots=mv(m.decode_slots),
                                   prefills=[dataclasses.replace(p, blocks=mv(p.blocks), mask=mv(p.mask))
                                             for p in m.prefills])
        images = tuple(mv(t) for t in self.images) if self.images is not None else None
        return StepInput(mv(self.input_ids), mv(self.positions), meta, mv(self.logits_indices), images)


def prepare_step(seqs, num_new: list[int], block_size: int, fresh_prefill_direct: bool,
                 all_logits: bool = False, *, window: int | None) -> StepInput:
    """The flat token batch and attention metadata of one step, on CPU.

    Single-token entries must come first. Logits are produced for the last token of every sequence whose
    computed tokens reach its end (it samples), or for every token when all_logits is set. `window` is the model's
    sliding attention window (ModelSpec.sliding_window), which every mask applies.
    """
    # built from Python lists, a handful of tensors a step: a batch-1 decode step is ~0.05 ms of it, not 0.2
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    starts = [s.num_computed_tokens for s in seqs]
    for s, st, n in zip(seqs, starts, num_new):
        table = s.block_table
        ids.extend(s.token_ids[st:st + n])
        pos.extend(range(st, st + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(st, st + n))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long))
    bd = 0
    while bd < len(seqs) and num_new[bd] == 1:
        bd += 1
    if bd:
        nblk = max(starts[:bd]) // block_size + 1
        meta.num_decode = bd
        meta.decode_slots = torch.tensor([s.state_slot for s in seqs[:bd]], dtype=torch.long)
        meta.decode_blocks = torch.tensor([_padded(s.block_table, nblk) for s in seqs[:bd]], dtype=torch.long)
        last = torch.tensor(starts[:bd], dtype=torch.long)  # each decode's query position
        meta.decode_mask = attends(last[:, None], torch.arange(nblk * block_size)[None, :], window).view(bd, 1, 1, -1)
    q_start = bd
    image_rows, image_embeds = [], []
    for i in range(bd, len(seqs)):
        st, n = starts[i], num_new[i]
        ctx = st + n
        rows, cols = torch.arange(st, ctx)[:, None], torch.arange(ctx)[None, :]
        spans = [im for im in seqs[i].images if im.start < ctx and im.end > st]
        for im in spans:  # the chunk's share of each image (Sequence.chunk ends it at an image's end)
            lo, hi = max(im.start, st), min(im.end, ctx)
            image_rows.append(torch.arange(q_start + lo - st, q_start + hi - st))
            image_embeds.append(im.embeds[lo - im.start:hi - im.start])
        if st == 0 and fresh_prefill_direct and not spans:  # its own fresh K/V: SDPA's is_causal, unless the
            mask = attends(rows, cols, window) if window is not None and n > window else None  # window cuts in
            meta.prefills.append(PrefillChunk(q_start, n, None, mask, st, seqs[i].state_slot))
            q_start += n
            continue
        mask = attends(rows, cols, window)
        for im in spans:  # an image's tokens see each other both ways (Gemma 3's mask)
            mask |= (rows >= im.start) & (rows < im.end) & (cols >= im.start) & (cols < im.end)
        if st == 0 and fresh_prefill_direct:
            meta.prefills.append(PrefillChunk(q_start, n, None, mask, st, seqs[i].state_slot))
        else:
            blocks = torch.tensor([_padded(seqs[i].block_table, -(-ctx // block_size))], dtype=torch.long)
            meta.prefills.append(PrefillChunk(q_start, n, blocks, mask, st, seqs[i].state_slot))
        q_start += n
    if all_logits:
        logits_idx = torch.arange(len(ids))
    else:
        ends = itertools.accumulate(num_new)
        logits_idx = torch.tensor([e - 1 for e, s, st, n in zip(ends, seqs, starts, num_new) if st + n == s.num_tokens],
                                  dtype=torch.long)
    images = (torch.cat(image_rows), torch.cat(image_embeds)) if image_rows else None
    return StepInput(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, logits_idx,
                     images)


def _padded(table: list[int], n: int) -> list[int]:
    """The first n entries of a block table, padded with block 0 (its positions are masked)."""
    return table[:n] + [0] * (n - len(table))
