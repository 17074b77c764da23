"""Shared-prefix groups of a decode batch (cascade attention, as FlashInfer's cascade and Hydragen).

The prefix cache shares physical blocks, so sequences whose block tables start with the same block ids hold the
same leading K/V. Their decode queries attend that shared run together (its blocks are read once for the whole
group) and each sequence's own suffix separately; the two partial results are merged by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

# NOTE: a group costs one extra partial result and merge per member; below a couple of blocks the shared read
# saves less than that.
CASCADE_MIN_BLOCKS = 2


@dataclass
class SharedPrefix:
    """Decode entries `members` (indices into the batch) that share their first `num_tokens` tokens of KV."""

    members: list[int]
    num_tokens: int


def _common_blocks(tables: list[list[int]], members: list[int]) -> int:
    """How many leading block ids all members' tables have in common."""
    first = tables[members[0]]
    n = min(len(tables[i]) for i in members)
    for i in members[1:]:
        t = tables[i]
        k = 0
        while k < n and t[k] == first[k]:
            k += 1
        n = k
    return n


def shared_prefixes(tables: list[list[int]], context_lens: list[int], block_size: int,
                    min_blocks: int = CASCADE_MIN_BLOCKS) -> list[SharedPrefix]:
    """Groups of ≥ 2 decode entries with ≥ `min_blocks` identical leading blocks (entries grouped by first block).

    The shared run stops one token before the shortest member's end, so every member keeps a non-empty suffix
    (its newest token at least) and the shared part is never a partially written block of one of them.
    """
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        if t:
            by_first.setdefault(t[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        tokens = min(_common_blocks(tables, members) * block_size, min(context_lens[i] for i in members) - 1)
        if tokens >= min_blocks * block_size:
            groups.append(SharedPrefix(members, tokens))
    return groups
