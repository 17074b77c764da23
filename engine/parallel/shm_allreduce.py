"""The all-reduce of a CPU TP group's activations through shared memory, for ranks of one host (vLLM's CPU backend
keeps the same kind for the same reason).

A gloo all-reduce is a hand-off to gloo's thread on every rank and a TCP round trip: 0.56-1.27 ms inside a step on
this 2-core machine, twice per layer (BENCHMARKS.md, tensor parallelism), so a CPU TP group only cost. Here:
1. rank 0 makes a file in /dev/shm (its space taken up front: a full tmpfs fails here, not with SIGBUS at a write),
   names it in the group's TCPStore; every rank maps it and writes its pid into the header; once all are in, rank 0
   unlinks the name (the mappings stay: nothing is left behind however the ranks end);
2. the data area holds two sets of slots (alternated per call), one slot per rank of SLOT_BYTES; an all-reduce of
   call number s writes this rank's tensor into its slot of set s % 2, publishes s in its counter, waits until
   every counter reached s, then sums the slots in rank order into the tensor: every rank computes the same sum,
   in the same order, so they end with equal values, as after gloo's;
3. the set used by call s was last read by call s - 2, which every rank has finished once every counter reached
   s - 1: a rank checks that before it writes (it nearly always holds already), so the sets need no second barrier;
4. a wait spins for a moment (ranks on cores of their own arrive within microseconds), then yields the core (more
   ranks than cores), and from time to time checks that the peers it waits for are alive: a dead rank fails the
   call at once with RuntimeError, as a closed gloo socket would, and one that does not arrive within the group's
   timeout fails it too. The caller (engine/parallel/group.py) turns a tensor that does not fit a slot over to gloo.

NOTE: the counters are plain int64 stores and loads: x86 keeps stores in order (the data lands before the counter
that publishes it) and loads in order; the stores and loads are separate C calls, which the compiler cannot merge.
Other CPUs (Arm) order less, so groups there all-reduce over gloo.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import sys
import time
import uuid
from typing import Any

import numpy as np
import torch

from engine.parallel.store import wait_count

log = logging.getLogger(__name__)
SLOT_BYTES = 4 << 20  # per rank and set: [T, d] float32 up to 1M values (SmolLM2's 1,024-token prefill is 2.4 MB)
LINE = 64  # bytes per counter (one cache line each: no false sharing between ranks)
SPIN_S = 50e-6  # spin this long before yielding the core
CHECK_S = 0.01  # check the peers' pids this often while waiting
X86 = ("x86_64", "amd64")
ENV = "PDCLUSTER_TP_ALLREDUCE"  # "gloo": never this path (the bench's comparison, a host whose /dev/shm is small)


def wanted(device: torch.device) -> bool:
    """Whether a group on `device` all-reduces through shared memory: CPU groups on x86 (the ordering the counters
    rely on, see the module's NOTE), unless PDCLUSTER_TP_ALLREDUCE=gloo."""
    choice = os.environ.get(ENV, "shm")
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{ENV} must be 'shm' or 'gloo', got {choice!r}")
    return (device.type == "cpu" and choice == "shm" and platform.machine().lower() in X86
            and sys.platform.startswith("linux"))  # NOTE: /dev/shm and posix_fallocate


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, a rank that died and waits for its parent's wait, does not)."""
    if pid <= 0:
        return True  # NOTE: not written yet: the rank is attaching
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # NOTE: no /proc: assume alive; the group's timeout still bounds the wait


class ShmAllReduce:
    """One rank's side of the shared-memory all-reduce of a group (see the module docstring)."""

    @classmethod
    def join(cls, rank: int, size: int, store: Any, timeout_s: float,
             slot_bytes: int = SLOT_BYTES) -> ShmAllReduce | None:
        """Every rank's side (a collective over `store`); None on every rank when rank 0 could not make the memory
        (e.g. a container's small /dev/shm: the group all-reduces over gloo then, as the log says)."""
        if rank == 0:
            path = f"/dev/shm/pdcluster-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except OSError as e:
                return cls._without(store, e)
            try:
                os.posix_fallocate(fd, 0, cls.nbytes(size, slot_bytes))  # NOTE: ENOSPC now, not SIGBUS at a write
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                return cls._without(store, e)
            store.set("shm/path", path)
        else:
            path = store.get("shm/path").decode()
            if not path:
                return None
            fd = os.open(path, os.O_RDWR)
        return cls(rank, size, store, timeout_s, slot_bytes, path, fd)

    @staticmethod
    def _without(store: Any, error: OSError) -> None:
        log.warning("TP all-reduce over gloo: no shared memory for it (%s)", error)
        store.set("shm/path", "")

    @staticmethod
    def nbytes(size: int, slot_bytes: int) -> int:
        return 2 * size * LINE + 2 * size * slot_bytes

    def __init__(self, rank: int, size: int, store: Any, timeout_s: float, slot_bytes: int, path: str,
                 fd: int) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.slot_bytes = slot_bytes
        header = 2 * size * LINE  # counters, then pids
        total = self.nbytes(size, slot_bytes)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64, count=header // 8)
        self.counters = words[: size * LINE // 8 : LINE // 8]  # one per rank, a cache line apart
        self.pids = words[size * LINE // 8 :: LINE // 8]
        self.pids[rank] = os.getpid()
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header).view(2, size, slot_bytes)
        self.calls = 0
        store.add("shm/attached", 1)
        # NOTE: every rank waits for all (each one's pid is in the header before any call), then rank 0 unlinks
        try:
            wait_count(store, "shm/attached", size, timeout_s, f"shm all-reduce: {size} ranks did not all attach")
        finally:
            if rank == 0:
                os.unlink(path)

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (`fits(t)` must hold, on every rank alike)."""
        self.calls += 1
        s = self.calls
        n = t.numel()
        slots = self.data[s % 2, :, : n * t.element_size()].view(t.dtype)  # [size, n]
        self._wait(s - 1)
        slots[self.rank].copy_(t.view(-1))
        self.counters[self.rank] = s
        self._wait(s)
        out = t.view(-1)
        out.copy_(slots[0])
        for r in range(1, self.size):
            out.add_(slots[r])

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `t` (same shape and dtype on each; `fits(t)`), in rank order; the others: None.

        NOTE: rank 0's list is views of the slots, good until its next call (a follower writes that set again
        only once rank 0's counter shows the call after this one): use them before. A follower waits for nobody
        here (nothing to read), as a gather needs."""
        self.calls += 1
        s = self.calls
        slots = self.data[s % 2, :, : t.numel() * t.element_size()].view(t.dtype)
        self._wait(s - 1)
        slots[self.rank].copy_(t.view(-1))
        self.counters[self.rank] = s
        if self.rank:
            return None
        self._wait(s)
        return [slots[r].view(t.shape) for r in range(self.size)]

    def _wait(self, s: int) -> None:
        """Until every rank's counter reached `s` (a dead or missing rank raises RuntimeError)."""
        counters = self.counters
        if counters.min() >= s:
            return
        start = time.monotonic()
        check = start + CHECK_S
        while counters.min() < s:
            now = time.monotonic()
            if now - start > SPIN_S:
                time.sleep(0)  # NOTE: yields the core to a rank that shares it (more ranks than cores)
            if now > check:
                self._check_peers(s, now - start)
                check = now + CHECK_S

    def _check_peers(self, s: int, waited_s: float) -> None:
        late = [r for r in range(self.size) if self.counters[r] < s]
        dead = [r for r in late if not _alive(int(self.pids[r]))]
        if dead:
            raise RuntimeError(f"shm all-reduce: rank(s) {dead} died (pid {[int(self.pids[r]) for r in dead]})")
        if waited_s > self.timeout_s:
            raise RuntimeError(f"shm all-reduce: rank(s) {late} did not arrive within {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Drop this rank's mapping (when the group is done; a view still held elsewhere keeps it until it goes)."""
        del self.counters, self.pids, self.data
        try:
            self._map.close()
        except BufferError:
            pass  # NOTE: a view outlives the group: the mapping goes with the last of them
