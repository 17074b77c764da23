"""A TP group's own channels (engine/parallel/group.py): the step messages rank 0 broadcasts, the pool size the
ranks agree on, and the all-reduce through shared memory (engine/parallel/shm_allreduce.py; gloo on the CPU; no
engine).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import EngineConfig
from engine.loader import LoadedModel, tiny_model
from engine.model_runner import ModelRunner
from engine.parallel import rank_config, shard_weights
from engine.parallel.follower import CopyBlock, StepMessage, Stop, agree_pool
from engine.parallel.group import MESSAGE_BYTES, Rendezvous, TPGroup, serve_store
from engine.parallel.shm_allreduce import SLOT_BYTES, ShmAllReduce
from pdcluster.config import ClusterConfig
from tests.test_tensor_parallel import LAYOUTS


def _receive(rdv: Rendezvous, n: int, out: Any) -> None:
    out.put("started")
    group = TPGroup(1, rdv, torch.device("cpu"))
    out.put([group.broadcast_object() for _ in range(n)])


@pytest.mark.parametrize("channel", ["pipe", "gloo"])
def test_step_messages_of_any_size_reach_the_followers_after_any_idle_time(channel: str, monkeypatch) -> None:
    import time

    import torch.multiprocessing as mp

    monkeypatch.setenv("PDCLUSTER_TP_STEP_CHANNEL", channel)  # NOTE: the spawned follower inherits it

    # NOTE: one broadcast up to MESSAGE_BYTES, a second for the rest of a longer one (a long prompt's step)
    fits = next(k for k in range(MESSAGE_BYTES - 64, MESSAGE_BYTES)  # a string whose pickle fills the first one
                if len(pickle.dumps("x" * k, protocol=pickle.HIGHEST_PROTOCOL)) == MESSAGE_BYTES - 8)
    messages = [Stop(), CopyBlock(3, 4),
                StepMessage(list(range(9000)), [0], [9000], [list(range(600))], [8999], ["sql"]),
                "x" * fits, "x" * (fits + 1)]
    ctx = mp.get_context("spawn")
    store, rdv = serve_store(2, timeout_s=3.0)  # NOTE: the collectives' bound; idling longer is no failure
    out = ctx.Queue()
    child = ctx.Process(target=_receive, args=(rdv, len(messages), out), daemon=True)
    child.start()
    try:
        assert out.get(timeout=60) == "started"  # NOTE: the rendezvous is then within the 3 s
        group = TPGroup(0, rdv, torch.device("cpu"), store)
        assert (group.steps is not None) == (channel == "pipe")
        time.sleep(4.0)  # an engine with nothing to do: the follower waits for its next step
        for m in messages:
            group.broadcast_object(m)
        assert out.get(timeout=60) == messages  # NOTE: a guard against a hang, not a timing
    finally:
        child.join(10)


def test_ranks_that_sized_their_pools_apart_all_take_the_smallest() -> None:
    """gpu_memory_utilization under TP: each rank sizes its pool on its own GPU, then the group agrees on the
    smallest count (block i of a sequence is block i on every rank). Here two ranks of one process, on threads."""
    loaded: LoadedModel = tiny_model(**LAYOUTS["gqa-8q-4kv"])
    ecfg = EngineConfig(num_threads=1, tensor_parallel_size=2)
    runners = [ModelRunner(rank_config(loaded.config, 2), ecfg,
                           shard_weights(loaded.config, loaded.weights, rank, 2), blocks, 64)
               for rank, blocks in ((0, 40), (1, 25))]
    runners[0].kv[0, 0, 24].fill_(1.0)
    store, rdv = serve_store(2, timeout_s=30.0)
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            agree_pool(runners[rank], TPGroup(rank, rdv, torch.device("cpu"), store if rank == 0 else None))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for r in runners:
        assert (r.num_blocks, r.spare_block, r.kv.shape[2]) == (25, 25, 26)  # NOTE: and the spare block
        assert len(r.kv_caches) == loaded.config.num_layers and r.kv_caches[0][0].shape[0] == 26
    assert float(runners[0].kv.abs().sum()) == 0.0  # a new pool: nothing of the old one carried over


def test_a_tp_pool_on_cuda_may_be_sized_by_gpu_memory_utilization() -> None:
    # NOTE: each rank profiles its own GPU and the group takes the smallest pool (the test above)
    cfg = ClusterConfig.from_yaml_text("model: tiny\nprefill:\n  device: cuda\n  num_gpus: 1\n"
                                       "  tensor_parallel_size: 2\n  gpu_memory_utilization: 0.8\n"
                                       "decode:\n  device: cuda\n  num_gpus: 1\n")
    engine_cfg = cfg.prefill.engine_config()
    assert (engine_cfg.tensor_parallel_size, engine_cfg.gpu_memory_utilization) == (2, 0.8)
    assert engine_cfg.num_blocks is None and engine_cfg.kv_cache_memory_gb is None


def on_threads(n: int, fn: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """`fn(rank)` for ranks 0 .. n-1 at once, one thread each; their results (an exception is raised here)."""
    out: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - raised below
            out[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def tp_files() -> set[str]:
    """The shared-memory files of TP groups on this host (engine/parallel/shm_allreduce.py names them)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("pdcluster-tp-")}


@pytest.mark.parametrize("n", [2, 3])
def test_the_shared_memory_all_reduce_gives_every_rank_the_sum_in_one_order(n: int) -> None:
    store, rdv = serve_store(n, timeout_s=30.0)
    # NOTE: sizes that alternate the two sets of slots, a bfloat16 one, and one past a slot (gloo takes it)
    before = tp_files()
    shapes = [(3, 5), (1, 64), (257, 33), (2, 7), (SLOT_BYTES // 4 + 1,)]

    def rank_sums(rank: int) -> list[torch.Tensor]:
        group = TPGroup(rank, rdv, torch.device("cpu"), store if rank == 0 else None)
        assert group.shm is not None
        sums = []
        for i, shape in enumerate(shapes * 3):
            dtype = torch.bfloat16 if i % 5 == 3 else torch.float32
            t = inputs(i, shape, dtype)[rank].clone()
            group.all_reduce(t)
            sums.append(t)
        group.close()
        return sums

    def inputs(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]

    results = on_threads(n, rank_sums)
    for i, shape in enumerate(shapes * 3):
        dtype = torch.bfloat16 if i % 5 == 3 else torch.float32
        xs = inputs(i, shape, dtype)
        want = xs[0].clone()
        for x in xs[1:]:
            want += x  # NOTE: rank order, as the shared memory sums
        for r in range(n):
            assert torch.equal(results[r][i], results[0][i])  # every rank holds the same values
        torch.testing.assert_close(results[0][i], want, rtol=1e-6, atol=1e-6)
    assert tp_files() <= before  # NOTE: unlinked once every rank mapped it


@pytest.mark.parametrize("n", [2, 3])
def test_rank_0_gathers_every_ranks_logits_columns_in_rank_order(n: int) -> None:
    """The LM head split by vocabulary rows: each rank's [N, its rows] logits, side by side on rank 0, interleaved
    with all-reduces (they share the shared memory's slots), the last one past a slot (gloo's gather)."""
    store, rdv = serve_store(n, timeout_s=30.0)
    widths = [5] * (n - 1) + [3]  # NOTE: the last rank's vocabulary slice is short (padded for the gather)
    rows = [1, 4, 7, SLOT_BYTES // (4 * 5) + 1]

    def part(i: int, rank: int) -> torch.Tensor:
        return torch.randn(rows[i % len(rows)], widths[rank], generator=torch.Generator().manual_seed(10 * i + rank))

    def gathered(rank: int) -> list[torch.Tensor | None]:
        group = TPGroup(rank, rdv, torch.device("cpu"), store if rank == 0 else None)
        assert group.shm is not None
        out = []
        for i in range(2 * len(rows)):
            out.append(group.gather_columns(part(i, rank), widths))
            x = torch.ones(3)
            group.all_reduce(x)
            assert torch.equal(x, torch.full((3,), float(n)))
        group.close()
        return out

    results = on_threads(n, gathered)
    for i in range(2 * len(rows)):
        assert torch.equal(results[0][i], torch.cat([part(i, r) for r in range(n)], dim=1))
        assert all(results[r][i] is None for r in range(1, n))


@pytest.mark.parametrize("leaves", [0, 1])
def test_a_rank_that_left_fails_the_step_pipes_at_once(leaves: int) -> None:
    """Rank 0 gone: a follower's wait for the next step ends with RuntimeError (end of file); a follower gone: rank
    0's next step message fails (a closed pipe). A dead process closes its ends as `close` does here."""
    store, rdv = serve_store(3, timeout_s=30.0)
    before = tp_files()
    groups = on_threads(3, lambda rank: TPGroup(rank, rdv, torch.device("cpu"), store if rank == 0 else None))
    assert all(g.steps is not None for g in groups) and tp_files() <= before  # NOTE: the FIFOs' names are gone
    groups[0].broadcast_object("step 1")
    assert [groups[r].broadcast_object() for r in (1, 2)] == ["step 1", "step 1"]
    groups[leaves].close()
    start = time.monotonic()
    if leaves == 0:
        for r in (1, 2):
            with pytest.raises(RuntimeError, match="rank 0 is gone"):
                groups[r].broadcast_object()
    else:
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            groups[0].broadcast_object("step 2")
    assert time.monotonic() - start < 5.0  # NOTE: a guard against waiting for the group's 30 s, not a timing
    for g in groups:
        g.close()


def _join_and_leave(rdv: Rendezvous) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(rdv.host, rdv.port, rdv.size, False, timeout=datetime.timedelta(seconds=rdv.timeout_s))
    ShmAllReduce.join(1, rdv.size, store, rdv.timeout_s)  # NOTE: then this process ends: a rank that died


def test_a_rank_that_died_fails_the_shared_memory_all_reduce_at_once() -> None:
    import torch.multiprocessing as mp

    store, rdv = serve_store(2, timeout_s=30.0)
    child = mp.get_context("spawn").Process(target=_join_and_leave, args=(rdv,), daemon=True)
    child.start()
    shm = ShmAllReduce.join(0, 2, store, 30.0)
    assert shm is not None
    child.join(60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died"):
        shm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5.0  # NOTE: a guard against waiting for the group's 30 s, not a timing
    shm.close()


def test_gloo_can_be_chosen_for_the_all_reduce(monkeypatch) -> None:
    monkeypatch.setenv("PDCLUSTER_TP_ALLREDUCE", "gloo")
    store, rdv = serve_store(2, timeout_s=30.0)
    groups = on_threads(2, lambda rank: TPGroup(rank, rdv, torch.device("cpu"), store if rank == 0 else None))
    assert all(g.shm is None for g in groups)
    sums = on_threads(2, lambda rank: (t := torch.full((3,), float(rank + 1)), groups[rank].all_reduce(t), t)[2])
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in sums)
    logits = on_threads(2, lambda rank: groups[rank].gather_columns(torch.full((2, 2 - rank), float(rank)), [2, 1]))
    assert torch.equal(logits[0], torch.tensor([[0.0, 0.0, 1.0]] * 2)) and logits[1] is None
