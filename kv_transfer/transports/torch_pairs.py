"""Pair groups of the `torch` transport: a two-rank process group per (sender, receiver), and its turn order.

Both ends of a pair run their transfers one after another in tag order (`Pair.wait_turn` / `end_turn`); a broken
pair (a dead peer, a stream out of step, a lost receiver) is retired and the next transfer makes a fresh group.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kv_transfer.state import TransferError

SENDER, RECEIVER = 0, 1
ANY_ADDRESS = ("0.0.0.0", "::", "")  # a bind-all host names no address a peer could connect to
# NOTE: a transfer's turn may wait for its prompt's prefill (keep-alives hold it meanwhile) and a gloo wait that
# times out closes the pair, so waits for a turn and its intro are long; a dead peer ends them sooner (TCP close).
QUEUED_WAIT_S = 600.0


def wait_all(works: list[Any], deadline: float) -> None:
    """Wait for torch.distributed work items until `deadline` (time.monotonic())."""
    for w in works:
        w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))


def address_towards(host: str) -> str:
    """This machine's address on the interface that reaches `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def make_group(backend: str, store: dist.Store, key: str, rank: int, timeout: float, local_host: str,
               device: str = "cuda") -> Any:
    """A two-rank process group under `key` (blocks until both ranks joined or `timeout` passes); this rank's gloo
    device listens on `local_host`, the address the other rank connects to; nccl sends from `device`."""
    prefixed = dist.PrefixStore(f"pdcluster/kv/{key}", store)
    if backend == "gloo":
        # NOTE: gloo's default device binds the address the hostname resolves to, often 127.0.0.1: a peer on
        # another node then connects to its own loopback (tests/test_multinode.py found it)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=timeout)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host) if local_host not in ANY_ADDRESS
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    refuse_one_gpu(prefixed, rank, gpu_identity(device), timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)


def gpu_identity(device: str = "cuda") -> str:
    """The UUID of the GPU `device` names here ('cuda': the current one): the same for every process on that GPU."""
    import torch

    index = torch.device(device).index
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def refuse_one_gpu(store: dist.Store, rank: int, gpu: str, timeout: float) -> None:
    """Raise TransferError naming transfer.torch_backend when both ranks of a pair compute on GPU `gpu`.

    NOTE: NCCL cannot pair two ranks on one device (ncclCommInitRank fails, or hangs, with "Duplicate GPU
    detected"): two pools sharing a GPU (fractional num_gpus) must move KV another way. Each rank posts its GPU's
    UUID to the pair's store and reads the other's before the NCCL group is made.
    """
    store.set(f"gpu/{rank}", gpu)
    other = f"gpu/{1 - rank}"
    store.wait([other], timedelta(seconds=timeout))
    if store.get(other).decode() == gpu:
        raise TransferError(f"transfer.torch_backend: 'nccl' cannot pair two ranks on one GPU (both workers "
                            f"compute on {gpu}): give the prefill and decode pools a GPU each (num_gpus: 1), or "
                            "use transfer.transport 'nixl' (CUDA IPC between processes of one GPU)")


@dataclass
class Pair:
    """One end of a pair group, with its transfers in tag order."""

    key: str
    group: Future[Any] = field(default_factory=Future)
    tags: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    turn: int = 1  # the tag whose data may move now
    cond: threading.Condition = field(default_factory=threading.Condition)
    broken: bool = False

    def wait_turn(self, tag: int, timeout: float = QUEUED_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.turn != tag:
                if self.broken or not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TransferError("pair group broke or timed out before this transfer's turn", retryable=True)

    def wait_group(self, timeout: float = QUEUED_WAIT_S) -> Any:
        """The pair's process group once made; raises as soon as the pair broke (a lost receiver: the group may
        never form, and a TCPStore or gloo connect to a dead peer retries until its own timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.group.result(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if self.broken or time.monotonic() >= deadline:
                    raise TransferError("pair group broke or timed out before it formed", retryable=True) from None

    def end_turn(self, tag: int) -> None:
        with self.cond:
            self.turn = max(self.turn, tag + 1)
            self.cond.notify_all()

    def breaks(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


def retire(pair: Pair, pairs: dict, lock: threading.Lock) -> None:  # type: ignore[type-arg]
    """Break `pair` and drop it from `pairs` (whatever its key), so the next transfer makes a fresh group."""
    pair.breaks()
    with lock:
        for key in [k for k, p in pairs.items() if p is pair]:
            del pairs[key]
