"""No KV write after free (issue 14, item 3): an abort on the decode side while a receiver write is mid-copy.

Writes into a reservation run outside the engine lock, so an abort could free the blocks while a copy is under way
and hand them to another sequence before the copy lands. The engine's free waits for the writes in flight and drops
every later one. A write is held mid-copy by an Event in the copy function the test injects; deterministic.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine import EngineConfig, LLMEngine
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError, TransferState, payload
from tests.helpers import describe, free_blocks, random_prompts

PROMPT = random_prompts(1, [90], vocab=1000, seed=5)[0]  # 6 blocks: the whole pool below


def filled(engine: LLMEngine, value: float) -> torch.Tensor:
    return torch.full((6, *engine.kv_layout.block_shape), value)  # [6 blocks, block_size, KVH, D]


@pytest.fixture
def pool(tiny):
    """A decode engine whose pool holds exactly one PROMPT's 6 blocks (a freed block is the next one handed out)."""
    engine = LLMEngine(tiny, EngineConfig(num_blocks=6, num_threads=1, enable_prefix_caching=False))
    ep = ReceiverEndpoint(engine, TransferConfig(transport="local"), local_name="abort-fence")
    yield engine, ep
    ep.close()


@pytest.mark.parametrize("order", ["engine_first", "receiver_first"])
def test_an_abort_waits_for_the_copy_in_flight_and_later_writes_are_dropped(pool, order):
    b, ep = pool
    baseline = free_blocks(b)
    copy = b.kv_importer.write_blocks
    entered, go = threading.Event(), threading.Event()

    def held_copy(layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        if not entered.is_set():  # only the first write (the doomed transfer's) is held mid-copy
            entered.set()
            assert go.wait(10)
        copy(layer, which, block_ids, kv)

    b.kv_importer.write_blocks = held_copy
    prepared = ep.receiver.prepare(describe(b, "doomed", PROMPT))
    ones = filled(b, 1.0)
    chunk = payload.seal(prepared.transfer_id, 0, 0, 0, ones)
    writer = threading.Thread(target=ep.receiver.on_tensor, args=(chunk, ones))
    writer.start()
    assert entered.wait(10)
    other_k: list[torch.Tensor] = []

    def abort_then_reuse() -> None:  # the decode worker's abort, then a new transfer that gets the freed blocks
        with ep.receiver.engine_lock:
            if order == "engine_first":  # what DecodeWorker.abort does: loop.abort, then the receiver
                b.abort_request("doomed")
                ep.receiver.abort_request("doomed", "client went away")
            else:
                ep.receiver.abort_request("doomed", "client went away")
                b.abort_request("doomed")
            res = b.reserve_kv("other", b.kv_layout, PROMPT, len(PROMPT), describe(b, "other", PROMPT).block_hashes)
            b.write_kv_blocks(res, 0, 0, 0, filled(b, 2.0))
            other_k.append(b.runner.read_blocks(0, res.fresh_blocks)[0])

    aborter = threading.Thread(target=abort_then_reuse)
    aborter.start()
    aborter.join(0.5)
    waited = aborter.is_alive() and free_blocks(b) == baseline - 6  # the free waits while the copy is held
    go.set()
    writer.join(10)
    aborter.join(10)
    assert not aborter.is_alive()

    with ep.receiver.engine_lock:
        k_now = b.runner.read_blocks(0, list(range(6)))[0]
    # the blocks handed on keep the new owner's KV: the doomed copy landed before the free, not after
    assert bool((other_k[0] == 2.0).all()) and bool((k_now == 2.0).all())
    assert waited
    late = payload.seal(prepared.transfer_id, 0, 0, 0, filled(b, 3.0))
    with pytest.raises(TransferError, match="client went away"):
        ep.receiver.on_tensor(late, filled(b, 3.0))
    assert bool((b.runner.read_blocks(0, list(range(6)))[0] == 2.0).all())  # ... and a late one never does
    assert ep.receiver.poll("doomed") is TransferState.FAILED and ep.receiver.num_inflight == 0

    b.abort_request("other")
    assert free_blocks(b) == baseline and b.stats().num_reserved == 0


def test_the_engine_drops_a_write_into_a_freed_reservation(pool):
    b, _ = pool
    res = b.reserve_kv("doomed", b.kv_layout, PROMPT, len(PROMPT), describe(b, "doomed", PROMPT).block_hashes)
    b.abort_request("doomed")
    other = b.reserve_kv("other", b.kv_layout, PROMPT, len(PROMPT), describe(b, "other", PROMPT).block_hashes)
    assert sorted(other.fresh_blocks) == sorted(range(6))  # the freed blocks, handed on
    b.write_kv_blocks(other, 0, 1, 0, filled(b, 2.0))
    with pytest.raises(KeyError, match="write dropped"):
        b.write_kv_blocks(res, 0, 1, 0, filled(b, 1.0))
    assert bool((b.runner.read_blocks(0, other.fresh_blocks)[1] == 2.0).all())
    b.abort_request("other")
    assert free_blocks(b) == 6 and b.stats().num_reserved == 0
