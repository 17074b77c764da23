"""BlockPool / BlockManager without a model: reference counts, the LRU free list, prefix-cache hits and eviction."""

from __future__ import annotations

import pytest

from engine.block_hash import BlockHash
from engine.block_manager import BlockManager, BlockPool
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
SCOPE = "test-model|float32"


def make_seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(temperature=0.0), BS, SCOPE)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` as the scheduler and engine do: link cached blocks, allocate the rest, compute, register."""
    hits = bm.match_prefix(seq)
    assert bm.allocate(seq, len(seq) - len(hits) * BS, hits)
    seq.num_computed_tokens = len(seq)
    bm.register_full_blocks(seq)
    return hits


def refs(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm.pool.blocks[b].ref_count for b in block_ids]


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)), "a")  # 2 full blocks + 2 tokens
    prefill(bm, a)
    b = make_seq(list(range(8)) + [100, 101, 102], "b")  # shares a's 2 full blocks
    hits = prefill(bm, b)

    assert hits == a.block_table[:2] == b.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert refs(bm, a.block_table) == [2, 2, 1] and refs(bm, b.block_table[2:]) == [1]
    assert bm.num_free_blocks == 16 - 4

    shared, a_tail = a.block_table[:2], a.block_table[2]
    bm.free(a)
    assert refs(bm, shared) == [1, 1] and not any(bm.pool.is_free(x) for x in shared)
    assert bm.pool.is_free(a_tail) and bm.num_free_blocks == 16 - 3

    bm.free(b)
    assert refs(bm, shared) == [0, 0] and bm.num_free_blocks == 16
    assert a.block_table == b.block_table == [] and a.num_computed_tokens == b.num_computed_tokens == 0


def test_lru_free_list_evicts_least_recently_freed_block_first():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    for bid in (2, 0, 3, 1):
        pool.release([bid])
    assert [pool.allocate() for _ in range(4)] == [2, 0, 3, 1]


def test_release_frees_a_sequences_tail_before_its_prefix():
    """Blocks released together go to the free list tail first, so a shared prefix is evicted last."""
    pool = BlockPool(5)
    ids = [pool.allocate() for _ in range(3)]  # [0, 1, 2]: one sequence's blocks, prefix first
    pool.release(ids)
    assert [pool.allocate() for _ in range(5)] == [3, 4, 2, 1, 0]


def test_freed_block_stays_cached_and_is_hit_until_reallocated():
    pool = BlockPool(3)
    h, toks = BlockHash(b"h" * 32), [1, 2, 3, 4]
    bid = pool.allocate()
    pool.register(bid, h, toks)
    pool.release([bid])
    assert pool.is_free(bid) and pool.num_cached_blocks == 1
    assert pool.lookup(h, toks) == bid

    pool.acquire(bid)  # a hit on a free block takes it off the free list
    assert not pool.is_free(bid) and pool.num_free_blocks == 2 and pool.blocks[bid].ref_count == 1
    pool.release([bid])
    assert pool.num_free_blocks == 3

    others = [pool.allocate(), pool.allocate()]  # the two never-used blocks go first
    assert bid not in others and pool.lookup(h, toks) == bid
    assert pool.allocate() == bid  # reused at last: its prefix entry is evicted
    assert pool.lookup(h, toks) is None and pool.num_cached_blocks == 0
    assert pool.blocks[bid].hash is None and pool.blocks[bid].token_ids == ()


def test_freed_sequence_is_served_from_cache_by_the_next_one():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), "a")
    prefill(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.pool.num_cached_blocks == 2

    b = make_seq(list(range(9)), "b")
    assert prefill(bm, b) == cached
    assert b.block_table[:2] == cached and bm.num_free_blocks == 4 - 3
    bm.free(b)

    c = make_seq(list(range(500, 516)), "c")  # 4 other blocks: every cached block is reused
    assert prefill(bm, c) == []
    assert bm.pool.num_cached_blocks == 4 and bm.match_prefix(make_seq(list(range(9)), "d")) == []


def test_hash_hit_is_confirmed_by_comparing_tokens():
    pool = BlockPool(2)
    h = BlockHash(b"x" * 32)
    bid = pool.allocate()
    pool.register(bid, h, [1, 2, 3, 4])
    assert pool.lookup(h, [1, 2, 3, 5]) is None
    assert pool.lookup(h, [1, 2, 3, 4]) == bid


def test_forged_hash_with_other_tokens_is_a_miss():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)), "a")
    prefill(bm, a)
    forged = make_seq([7] * 9, "forged")
    forged.block_hash = a.block_hash  # type: ignore[method-assign]  # same hashes, other tokens
    assert forged.block_hash(0) == a.block_hash(0)
    assert bm.match_prefix(forged) == []
    assert bm.match_prefix(make_seq(list(range(9)), "honest")) == a.block_table[:2]


@pytest.mark.parametrize(("num_tokens", "expected_hits"),
                         [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (40, 3)])
def test_match_prefix_leaves_at_least_one_token_to_compute(num_tokens, expected_hits):
    """With 3 blocks cached, a prompt of exactly N full blocks gets at most N - 1 hits."""
    bm = BlockManager(32, BS)
    tokens = list(range(100, 140))
    prefill(bm, make_seq(tokens[:12], "cached"))  # 3 full blocks cached
    seq = make_seq(tokens[:num_tokens])
    hits = bm.match_prefix(seq)
    assert len(hits) == expected_hits
    assert len(seq) - len(hits) * BS >= 1


def test_allocate_is_all_or_nothing_when_blocks_run_out():
    bm = BlockManager(4, BS)
    big = make_seq(list(range(17)))  # needs 5 blocks
    assert not bm.allocate(big, 17)
    assert big.block_table == [] and big.num_computed_tokens == 0 and bm.num_free_blocks == 4

    fits = make_seq(list(range(16)))
    assert bm.allocate(fits, 16) and len(fits.block_table) == 4 and bm.num_free_blocks == 0
    fits.num_computed_tokens = 16
    assert not bm.allocate(fits, 1)  # growing past the pool fails too, and keeps what it had
    assert len(fits.block_table) == 4


def test_allocate_with_prefix_hits_fails_without_taking_the_hits():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), "a")
    prefill(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)) + list(range(50, 59)), "b")  # 2 cached blocks + 9 tokens (3 blocks): 5 > 4
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert not bm.allocate(b, len(b) - 2 * BS, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and refs(bm, hits) == [0, 0] and bm.pool.num_cached_blocks == 2


def test_double_free_asserts():
    pool = BlockPool(2)
    bid = pool.allocate()
    pool.release([bid])
    with pytest.raises(AssertionError, match="double free"):
        pool.release([bid])


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(list(range(9)), "a"))
    assert bm.pool.num_cached_blocks == 0
    assert bm.match_prefix(make_seq(list(range(9)), "b")) == []


def test_pool_events_report_stored_and_evicted_hashes_net_of_each_other():
    from engine.block_hash import BlockHash
    from engine.block_manager import BlockPool

    pool = BlockPool(2)
    assert pool.drain_events() == ([], [])  # off until a worker asks
    pool.enable_events()
    a, b, c = (BlockHash(bytes([i]) * 32) for i in range(3))
    x, y = pool.allocate(), pool.allocate()
    pool.register(x, a, [1])
    pool.register(y, b, [2])
    assert pool.drain_events() == ([a, b], [])
    pool.release([x, y])
    z = pool.allocate()  # reuses the least recently freed block: its hash leaves the cache
    pool.register(z, c, [3])
    stored, removed = pool.drain_events()
    assert stored == [c] and len(removed) == 1 and removed[0] in (a, b)
    assert pool.drain_events() == ([], [])
    assert set(pool.cached_hashes()) == {c, ({a, b} - set(removed)).pop()}
