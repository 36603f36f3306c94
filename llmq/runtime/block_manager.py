"""Paged KV-cache bookkeeping: fixed-size blocks with reference counts and automatic prefix caching.

A hybrid model's recurrent layers keep a fixed-size state per sequence instead: a sequence holding blocks also holds
one state slot (Sequence.state_slot), taken with its first block and returned with its last.

A full block is identified by the hash chain of its tokens (the hash of its parent block plus its own tokens), so
two requests with a common prefix share the blocks of that prefix. Freed blocks keep their contents and stay
findable until they are reused; free blocks are reused least-recently-freed first (LRU), blocks that hold nothing
findable before any cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .sequence import ImageSpan, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, state_slots: int = 0):
        self.num_blocks = num_blocks
        self.free_slots = list(range(state_slots))[::-1]  # a hybrid model's recurrent-state slots (0: none)
        self.has_slots = state_slots > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks  # (parent hash, tokens) of a cached block
        self.cached: dict[tuple, int] = {}  # (parent hash, tokens) -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front = reuse first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------------------
    def block_keys(self, token_ids: list[int], end: int, start: int = 0, prev: tuple | None = None,
                   images: tuple[ImageSpan, ...] = ()) -> Iterator[tuple]:
        """The prefix-cache keys of full blocks start..end-1 of token_ids (prev: block start-1's key).

        A key is (hash of the previous block's key, this block's tokens), and for a block holding image tokens (whose
        ids are all one placeholder) the digests and positions of those images: the hash chain that makes equal keys
        mean equal whole prefixes, pixels included. Computed here only: match_prefix, commit and the scorer use it.
        """
        bs = self.block_size
        for i in range(start, end):
            key = (None if prev is None else hash(prev), tuple(token_ids[i * bs:(i + 1) * bs]))
            seen = tuple((im.start, im.digest) for im in images if im.start < (i + 1) * bs and im.end > i * bs)
            if seen:
                key += (seen,)
            yield key
            prev = key

    def match_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Attach the cached blocks of the longest cached prefix (of its first `limit` tokens; None: all) to a
        sequence with no blocks; returns its tokens.

        At least one token (of the first `limit`) is always left to compute, because its logits are needed.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        end = seq.num_tokens if limit is None else limit
        for key in self.block_keys(seq.token_ids, (end - 1) // bs, images=seq.images):
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            seq.block_table.append(block)
            seq.last_block_key = key
        n = len(seq.block_table)
        seq.num_hashed_blocks = n
        seq.num_computed_tokens = n * bs
        return n * bs

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks (KV computed for all their tokens) in the cache."""
        if not self.enable_prefix_caching:
            return
        first = seq.num_hashed_blocks
        keys = self.block_keys(seq.token_ids, seq.num_computed_tokens // self.block_size, first, seq.last_block_key,
                               seq.images)
        for i, key in enumerate(keys, first):
            block = seq.block_table[i]
            if key not in self.cached and self.block_key[block] is None:
                self.cached[key] = block
                self.block_key[block] = key
            seq.num_hashed_blocks = i + 1
            seq.last_block_key = key

    # -- allocation -----------------------------------------------------------------------------------------
    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # evict: its contents are about to be overwritten
            del self.cached[key]
            self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's block table to hold `num_tokens` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        if self.has_slots and seq.state_slot < 0:
            if not self.free_slots:
                return False
            seq.state_slot = self.free_slots.pop()
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def _unref(self, block: int) -> None:
        """Drop one reference; at zero the block is free, reused first unless it holds a findable (cached) prefix."""
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None
            if self.block_key[block] is None:
                self.free.move_to_end(block, last=False)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks beyond the first `num_tokens` tokens (speculative tokens the target rejected). They
        were never committed, so they hold nothing findable."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            assert self.block_key[block] is None, "a block holding rejected tokens was hashed"
            self._unref(block)
        del seq.block_table[keep:]

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero become free (cached ones stay findable)."""
        for block in reversed(seq.block_table):  # tail blocks are the least likely to be shared: reuse them first
            self._unref(block)
        seq.block_table = []
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_key = None
