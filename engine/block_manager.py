"""Paged KV-cache bookkeeping: a block pool with reference counts, an O(1) LRU free list and prefix caching.

This module never touches tensors; the model runner owns the KV memory and reads block ids from here.

Life of a block: allocated (ref 1) → shared by later sequences with the same prefix (ref n) → freed (ref 0,
appended to the LRU free list, *still cached*) → either hit again (leaves the free list) or, when it reaches
the head of the free list and is allocated anew, evicted from the prefix cache. A cached block is evicted only
when it is reused, as in vLLM's block pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Sequence_

from engine.block_hash import BlockHash
from engine.sequence import Sequence


class Block:
    """One KV block: `block_size` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockPool:
    """Fixed set of blocks; free ones sit in LRU order (head = evicted first)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_prefix_caching = enable_prefix_caching
        # NOTE: OrderedDict gives O(1) pop-from-head, append and removal from the middle (on a cache hit).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # NOTE: None until a worker asks for events (the prefix index follows them); then drained by the worker.
        self._events: dict[BlockHash, bool] | None = None  # hash → True stored / False evicted, latest wins

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash, token_ids: list[int]) -> int | None:
        """Block id holding exactly these tokens under this hash, or None (hash hit confirmed by tokens)."""
        bid = self._cached.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids):
            return None
        return bid

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def acquire(self, block_id: int) -> None:
        """Take one more reference on a cached block (it leaves the free list if it was there)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def allocate(self) -> int:
        """Take the least recently freed block, evicting whatever prefix it cached."""
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self._cached.get(block.hash) == bid:
                del self._cached[block.hash]
                if self._events is not None:
                    self._events[block.hash] = False
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return bid

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per block; tail blocks first so a prefix outlives its suffixes in the LRU."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            assert block.ref_count > 0, f"double free of block {bid}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[bid] = None

    def register(self, block_id: int, block_hash: BlockHash, token_ids: list[int]) -> None:
        """Enter a full block in the prefix cache (the first block with a given hash wins)."""
        if not self.enable_prefix_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block_id
        if self._events is not None:
            self._events[block_hash] = True

    def enable_events(self) -> None:
        """Start recording which hashes enter and leave the prefix cache (for `drain_events`)."""
        if self._events is None:
            self._events = {}

    def has_events(self) -> bool:
        """Whether `drain_events` has anything (a read any thread may make without the engine's lock)."""
        return bool(self._events)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Hashes stored and evicted since the last drain (net of each other); needs `enable_events` first."""
        if self._events is None:
            return [], []
        events, self._events = self._events, {}
        return [h for h, s in events.items() if s], [h for h, s in events.items() if not s]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (to rebuild an index from scratch)."""
        return list(self._cached)


class BlockManager:
    """Maps sequences onto the pool: prefix matching, slot allocation, freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence_[BlockHash], token_ids: Sequence_[int]) -> list[int]:
        """Block ids of the leading blocks (given their hashes and tokens) that the prefix cache holds."""
        hits: list[int] = []
        for i, h in enumerate(hashes):
            bid = self.pool.lookup(h, list(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            if bid is None:
                break
            hits.append(bid)
        return hits

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Leading blocks of a new sequence already in the cache; at least one token is left to compute."""
        if not self.pool.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # NOTE: prompt logprobs need every prompt position's logits: nothing is skipped
        # NOTE: the last token is always recomputed: its logits are needed to sample the next one.
        return self.cached_prefix(seq.block_hashes((len(seq) - 1) // self.block_size), seq.token_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """Give `seq` slots for `num_new_tokens` more tokens (after linking `prefix_hits`); False if full."""
        hits = prefix_hits or []
        total = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(seq.block_table) - len(hits)
        # Hits on free (ref 0) blocks take those blocks out of the free list too.
        free_after_hits = self.pool.num_free_blocks - sum(1 for b in hits if self.pool.is_free(b))
        if need > free_after_hits:
            return False
        for bid in hits:
            self.pool.acquire(bid)
        seq.block_table.extend(hits)
        seq.block_table.extend(sorted(self.pool.allocate() for _ in range(max(need, 0))))  # NOTE: nixl merges runs
        if hits:
            seq.num_computed_tokens += len(hits) * self.block_size
            seq.num_registered_blocks = len(hits)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter blocks that became full during the last step into the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_table[i], seq.block_hash(i), seq.block_tokens(i))
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def truncate(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Roll the sequence's KV back to its first `num_computed_tokens` tokens (rejected drafts' slots go back).

        NOTE: only blocks past the kept tokens are released; they were never registered (drafts never are).
        """
        assert num_computed_tokens >= seq.num_registered_blocks * self.block_size, "cannot roll back cached blocks"
        keep = self.blocks_needed(num_computed_tokens)
        self.pool.release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_computed_tokens = num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (the parent's prompt, nothing computed) the parent's prompt KV: the blocks before the one
        holding the last prompt token by reference, that one as a fresh block to copy (copy-on-write: the child
        recomputes the last prompt token there). Returns (source, destination) block ids to copy, or None when no
        block is free (the child then starts from the queue, a prefix-cache hit).
        """
        last = (parent.num_prompt_tokens - 1) // self.block_size  # the block the child writes first
        if self.pool.num_free_blocks < 1 or len(parent.block_table) <= last:
            return None
        shared = parent.block_table[:last]
        for bid in shared:
            self.pool.acquire(bid)
        copy = self.pool.allocate()
        child.block_table = [*shared, copy]
        child.num_computed_tokens = parent.num_prompt_tokens - 1
        child.num_registered_blocks = min(parent.num_registered_blocks, last)
        return parent.block_table[last], copy

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks to the pool (they stay cached until reused)."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
