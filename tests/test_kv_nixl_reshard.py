"""nixl between TP groups of different sizes, without engines (kv_transfer/transports/nixl_reshard.py): which sender
ranks make each receiver rank's blocks, the blocks gathered for the others, and the checks the receiver computes over
what landed; the staging arena's slots (nixl_writes.py).

Pools here are random [layers, 2, blocks, rows, local heads, D] tensors cut from one full-layout pool as a TP group's
ranks hold it, including a split no tiny test model makes (6 KV heads: TP 2 holds 3 a rank, TP 3 holds 2, so a TP 3
rank's heads straddle two TP 2 ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer.transports.nixl_checks import layers_check
from kv_transfer.transports.nixl_reshard import Plan, Span, heads_problem
from kv_transfer.transports.nixl_writes import Staging

LAYERS, BLOCKS, ROWS, D = 2, 12, 4, 8


def split(kvh: int, n: int) -> list[tuple[int, int]]:
    """The KV heads of each rank of TP n (engine/parallel/shard.py `kv_heads_of`)."""
    if n <= kvh:
        return [(r * kvh // n, (r + 1) * kvh // n) for r in range(n)]
    return [(r // (n // kvh), r // (n // kvh) + 1) for r in range(n)]


def pools(full: torch.Tensor, heads: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [full[:, :, :, :, a:b].contiguous() for a, b in heads]


@pytest.mark.parametrize("kvh,a,b", [(6, 2, 3), (6, 3, 2), (4, 1, 2), (4, 4, 1), (2, 4, 1), (2, 1, 4), (6, 6, 2)])
def test_gathered_blocks_and_their_checks_are_what_the_receiver_holds(kvh: int, a: int, b: int) -> None:
    full = torch.randn(LAYERS, 2, BLOCKS, ROWS, kvh, D, generator=torch.Generator().manual_seed(kvh * 10 + a))
    src_heads, dst_heads = split(kvh, a), split(kvh, b)
    plan = Plan(src_heads, dst_heads, ROWS * D * 4)
    senders = pools(full, src_heads)
    ids, remote = np.asarray([3, 4, 5, 9, 1], dtype=np.int64), np.asarray([7, 8, 0, 1, 2], dtype=np.int64)
    slot = torch.zeros(max(1, plan.slot_nbytes(len(ids))), dtype=torch.uint8)
    plan.gather(senders, 1, ids, slot)
    # what the receiver holds once the WRITE landed: each rank's blocks `remote`, from a sender pool or the slot
    receivers = [torch.zeros(LAYERS, 2, BLOCKS, ROWS, hb - ha, D) for ha, hb in dst_heads]
    for r, t in enumerate(plan.targets):
        for which in (0, 1):
            got = (senders[t.direct][1, which, ids] if t.direct is not None
                   else plan._view(slot, which, r, len(ids), senders[0]))
            receivers[r][1, which, remote] = got
            ha, hb = dst_heads[r]
            assert torch.equal(got, full[1, which, ids][:, :, ha:hb])  # the receiver rank's own heads, in order
    for which in (0, 1):
        place = f"t/1/{which}"
        sent = plan.checks(senders, 1, which, ids, place, True, slot)
        assert sent == layers_check(receivers, 1, which, remote, place, like=sent)
        assert sent.count("+") == b - 1
    assert plan.gathers == (any(h not in src_heads for h in dst_heads))


def test_a_receiver_rank_straddling_two_sender_ranks_is_gathered_from_both() -> None:
    plan = Plan(split(6, 2), split(6, 3), 1)  # sender ranks hold 0-2, 3-5; receiver ranks 0-1, 2-3, 4-5
    assert [t.direct for t in plan.targets] == [None, None, None]
    assert plan.targets[1].spans == (Span(0, 2, 3, 0), Span(1, 0, 1, 1))
    assert Plan(split(2, 4), split(2, 2), 1).targets[1].direct == 2  # the first sender rank holding head 1
    assert not Plan(split(2, 4), split(2, 2), 1).gathers


@pytest.mark.parametrize("heads,problem", [([(0, 2)], "the ranks hold 2 of the model's 4 KV heads"),
                                           ([(0, 2), (2, 4), (0, 4)], "3 ranks' heads for a pool of 2 ranks"),
                                           ([(0, 3), (3, 4)], "as many heads each"),
                                           ([(0, 2), (2, 5)], "(2, 5) is not a range of the model's 4 KV heads")])
def test_a_head_split_that_cannot_fill_a_pool_says_why(heads: list[tuple[int, int]], problem: str) -> None:
    assert problem in (heads_problem(heads, 2 if len(heads) != 1 else 1, 4) or "")
    assert heads_problem(split(4, 2), 2, 4) is None


def test_the_staging_arena_hands_out_slots_and_takes_them_back() -> None:
    arena = Staging(chunk_bytes=1 << 20, max_bytes=2 << 20)
    a, b = arena.take(300_000), arena.take(600_000)
    assert a is not None and b is not None and a.addr != b.addr and arena.nbytes == 1 << 20
    c = arena.take(700_000)  # NOTE: no room in the first chunk: a second one is registered
    assert c is not None and arena.nbytes == 2 << 20
    assert arena.take(700_000) is None  # NOTE: at max_bytes: wait for a slot to come back
    arena.give(a)
    arena.give(b)
    again = arena.take(900_000)  # NOTE: the two freed slots merged
    assert again is not None and again.chunk is a.chunk
    for s in (again, c):
        arena.give(s)
    assert arena.in_use == 0
