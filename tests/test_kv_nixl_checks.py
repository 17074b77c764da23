"""nixl's per-layer check (`layer_check`): CRC32C of the place, continued over the blocks in the order sent.

A decode pool hands out blocks in any order (freed tails first), so the check walks runs of consecutive ids; it must
equal the CRC of the blocks' bytes laid end to end in the order given, whatever the runs, and see any changed byte.
The engine hands a sequence its new blocks in ascending order, so NIXL merges them into few large copies.
"""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.transports.nixl_checks import block_runs, layer_check

IDS = {
    "ascending": list(range(3, 19)),
    "descending": list(range(40, 24, -1)),  # a decode pool's blocks after a sequence freed its tail first
    "scattered": [7, 8, 9, 2, 30, 31, 5, 4, 3, 60],
    "one": [11],
}


def _layer() -> torch.Tensor:
    return torch.randn(64, 16, 3, 8, generator=torch.Generator().manual_seed(1))  # [pool blocks, bs, KVH, D]


@pytest.mark.parametrize("order", sorted(IDS))
def test_check_is_the_crc_of_the_blocks_in_order(order: str) -> None:
    kv, ids = _layer(), np.asarray(IDS[order], dtype=np.int64)
    want = crc32c.crc32c(b"t/3/1")
    for bid in ids:
        want = crc32c.crc32c(kv[int(bid)].numpy().tobytes(), want)
    assert layer_check(kv, ids, "t/3/1") == str(want)
    assert layer_check(kv, ids, "t/3/0") != str(want)  # another place (layer, K/V) does not match
    assert layer_check(kv, ids, "t/3/1", enabled=False) == "-"


def test_check_sees_a_changed_byte_and_a_swapped_block() -> None:
    kv, ids = _layer(), np.asarray(IDS["scattered"], dtype=np.int64)
    before = layer_check(kv, ids, "t/0/0")
    swapped = ids.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    assert layer_check(kv, swapped, "t/0/0") != before
    kv.view(torch.uint8).view(64, -1)[31, 100] ^= 1  # one bit of block 31, a run's second block
    assert layer_check(kv, ids, "t/0/0") != before


def test_block_runs() -> None:
    assert block_runs(np.asarray(IDS["scattered"])) == ([7, 2, 30, 5, 4, 3, 60], [9, 2, 31, 5, 4, 3, 60])
    assert block_runs(np.asarray(IDS["ascending"])) == ([3], [18])


def test_blocks_freed_tail_first_come_back_ascending() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = Sequence("a", list(range(64)), SamplingParams(), 4, "m")
    assert bm.allocate(first, 64)
    bm.free(first)  # tail first: the free list now holds these 16 blocks in descending order
    again = Sequence("b", list(range(100, 164)), SamplingParams(), 4, "m")
    assert bm.allocate(again, 64)
    assert again.block_table == sorted(again.block_table) and len(set(again.block_table)) == 16
    assert block_runs(np.asarray(again.block_table[4:])) == ([again.block_table[4]], [again.block_table[-1]])


def test_a_layers_blocks_are_described_as_runs_consecutive_on_both_sides():
    from kv_transfer.transports.nixl_agent import run_descs, runs

    local, remote = np.array([4, 5, 6, 9, 10, 2]), np.array([7, 8, 20, 21, 22, 3])
    ls, rs, n = runs(local, remote)
    assert (ls.tolist(), rs.tolist(), n.tolist()) == ([4, 6, 9, 2], [7, 20, 21, 3], [2, 1, 2, 1])
    d = run_descs(1000, num_blocks=16, block_nbytes=10, device=0, layer=1, starts=ls, lengths=n)
    # layer 1's K region starts at block (1 * 2 + 0) * 16 = 32, its V region at 48
    starts = (4, 6, 9, 2)
    assert d[:, 0].tolist() == [1000 + (32 + b) * 10 for b in starts] + [1000 + (48 + b) * 10 for b in starts]
    assert d[:, 1].tolist() == [20, 10, 20, 10] * 2
    assert runs(np.zeros(0, np.int64), np.zeros(0, np.int64))[2].tolist() == []
