"""A simulated worker's KV block pool and prefix cache, mirroring `engine.block_manager` without tensors.

Blocks have reference counts; freed blocks join an LRU free list and stay cached until reused (the head of the
list is evicted first, a sequence's tail blocks are freed first); a full block enters the cache under a chained key
of its tokens, the first block with a key wins. Keys are Python ints (hash of the parent key and the block's token
ids), standing in for `engine.block_hash`: equal prefixes give equal keys, in every worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_KEY = 0


def block_keys(tokens: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """Chained keys of the first `num_blocks` full blocks of `tokens` (all full blocks by default)."""
    n = len(tokens) // block_size if num_blocks is None else num_blocks
    keys, parent = [], ROOT_KEY
    for i in range(n):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


class BlockCache:
    """`num_blocks` blocks; with an `index`, each block key this cache stores maps to worker `owner` there.

    NOTE: the index keeps the last worker that stored a key (not every holder): enough to find a candidate that
    caches the deepest prefix of a prompt in a pool of thousands; a worker's own depth is always exact (`depth`).
    """

    __slots__ = ("ref", "key", "free", "cached", "index", "owner")

    def __init__(self, num_blocks: int, index: dict[int, int] | None = None, owner: int = 0) -> None:
        self.ref = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks
        # NOTE: OrderedDict: O(1) pop of the least recently freed block, append, and removal on a hit.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.index, self.owner = index, owner

    @property
    def num_blocks(self) -> int:
        return len(self.ref)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def depth(self, keys: Sequence[int], limit: int | None = None) -> int:
        """How many leading blocks of `keys` (at most `limit`) this cache holds."""
        n = len(keys) if limit is None else min(limit, len(keys))
        cached, i = self.cached, 0
        while i < n and keys[i] in cached:
            i += 1
        return i

    def free_after(self, keys: Sequence[int]) -> int:
        """Free blocks left once the cached blocks of `keys` are taken (hits on free blocks leave the list)."""
        return len(self.free) - sum(1 for k in keys if self.ref[self.cached[k]] == 0)

    def acquire(self, keys: Sequence[int]) -> list[int]:
        """One more reference on each cached block of `keys` (all must be cached)."""
        out = []
        for k in keys:
            bid = self.cached[k]
            if self.ref[bid] == 0:
                del self.free[bid]
            self.ref[bid] += 1
            out.append(bid)
        return out

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks from the head of the free list (evicting what they cached), or None if too few are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            k = self.key[bid]
            if k is not None:
                if self.cached.get(k) == bid:
                    del self.cached[k]
                    if self.index is not None and self.index.get(k) == self.owner:
                        del self.index[k]
                self.key[bid] = None
            self.ref[bid] = 1
            out.append(bid)
        return out

    def register(self, bid: int, key: int) -> None:
        """Enter a full block under `key` (no-op when another block already holds that key)."""
        if key in self.cached:
            return
        self.key[bid] = key
        self.cached[key] = bid
        if self.index is not None:
            self.index[key] = self.owner

    def release(self, bids: Sequence[int]) -> None:
        """Drop one reference per block, tail first, so a prefix outlives its suffixes in the LRU."""
        ref, free = self.ref, self.free
        for bid in reversed(bids):
            ref[bid] -= 1
            if ref[bid] == 0:
                free[bid] = None
