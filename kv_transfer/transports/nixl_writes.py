"""What a nixl sender holds between a layer queued and its write completed: the process's staging arena for the
blocks it gathers (nixl_reshard.py), each queued layer's slot and checks, the posted WRITEs.

1. `Writes.queue`: a layer of pool blocks waits its turn on the sender's thread;
2. `Writes.ready`: the first one gets a slot of the arena if the plan gathers blocks (waiting while the arena is
   full, driving this transfer's writes: a completed one frees its slot) and its checks, computed on this thread;
   the layers behind it get theirs on the process's checker thread meanwhile, as far as the arena has room;
3. the sender posts it and `Writes.posted` holds its handle and slot;
4. `Writes.progress` drives NIXL: a completed write gives its slot back, a failed one fails the transfer;
   `Writes.drain` waits for the rest at the end, `Writes.close` gives back the slots of layers never posted.

The arena (`Staging`) is host memory registered with NIXL once per chunk (registration costs milliseconds: never
per transfer), shared by every nixl sender of the process; it grows by `CHUNK_BYTES` up to `MAX_BYTES`, past which
a sender waits for slots (and fails, retryable, at its deadline, naming the arena).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import host_memory
from kv_transfer.state import TransferError
from kv_transfer.transports.nixl_agent import agent
from kv_transfer.transports.nixl_checks import PoolLayer, checker
from kv_transfer.transports.nixl_reshard import Plan

CHUNK_BYTES = 64 << 20  # the arena grows by chunks of this size (or one layer's slot, if larger)
MAX_BYTES = 1 << 30  # past this, a sender waits for slots to be freed (and fails at its deadline)
ALIGN = 4096
POLL_S = 0.0002  # how often a sender waiting for a slot drives NIXL (or looks again, with no write of its own)


@dataclass(eq=False)
class Slot:
    """`nbytes` of a chunk of the staging arena, from `offset`."""

    chunk: _Chunk
    offset: int
    nbytes: int

    @property
    def tensor(self) -> torch.Tensor:
        return self.chunk.mem[self.offset : self.offset + self.nbytes]

    @property
    def addr(self) -> int:
        return self.chunk.mem.data_ptr() + self.offset


@dataclass(eq=False)
class _Chunk:
    mem: torch.Tensor  # uint8, registered with NIXL for the life of the process
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, size), by offset

    def take(self, nbytes: int) -> int | None:
        for i, (offset, size) in enumerate(self.free):
            if size >= nbytes:
                self.free[i : i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        self.free.append((offset, nbytes))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged


class Staging:
    """This process's staging arena for gathered blocks: host memory in chunks, each registered with NIXL once
    (registration is costly: never per transfer), shared by every nixl sender here (thread safe)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, max_bytes: int = MAX_BYTES) -> None:
        self.chunk_bytes, self.max_bytes = chunk_bytes, max_bytes
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The arena's size (every chunk registered so far)."""
        return sum(c.mem.numel() for c in self._chunks)

    @property
    def in_use(self) -> int:
        """Bytes of the arena in slots not given back."""
        with self._lock:
            return self.nbytes - sum(size for c in self._chunks for _, size in c.free)

    def take(self, nbytes: int) -> Slot | None:
        """A slot of `nbytes`, or None while the arena is full (at `max_bytes`: wait for slots to be freed)."""
        nbytes = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for chunk in self._chunks:
                offset = chunk.take(nbytes)
                if offset is not None:
                    return Slot(chunk, offset, nbytes)
            size = max(self.chunk_bytes, nbytes)
            if self._chunks and self.nbytes + size > self.max_bytes:
                return None  # NOTE: the first chunk always comes: a layer larger than max_bytes still goes
            mem = host_memory.zeros((size,), torch.uint8)
            agent().register_host(mem)
            chunk = _Chunk(mem, [(nbytes, size - nbytes)] if size > nbytes else [])
            self._chunks.append(chunk)
            return Slot(chunk, 0, nbytes)

    def give(self, slot: Slot) -> None:
        with self._lock:
            slot.chunk.give(slot.offset, slot.nbytes)


@functools.cache
def staging() -> Staging:
    """This process's staging arena (made on first use; a chunk is registered when first needed).

    NOTE: `functools.cache` may build two under a race and keep one: a new Staging holds and registers nothing."""
    return Staging()


Checks = Callable[[PoolLayer, Slot | None], tuple[str, str]]  # a layer's K and V checks (its blocks gathered first)
Posted = tuple[Any, int, Slot | None]  # a posted WRITE's handle, its layer, its staging slot


@dataclass(eq=False)
class Queued:
    """A layer on the sender's thread: its checks (computed, or on their way) and its staging slot."""

    layer: PoolLayer
    checks: Future[tuple[str, str]] | None = None
    slot: Slot | None = None

    def drop(self) -> None:
        """Not posted (or posted: `slot` is None then): its checks are not wanted, its slot goes back."""
        if self.checks is not None and not self.checks.cancel():
            try:
                self.checks.result()  # NOTE: running on the checker thread: it may still copy into the slot
            except Exception:  # noqa: BLE001 - its failure is the transfer's, raised where it is awaited
                pass
        if self.slot is not None:
            staging().give(self.slot)
            self.slot = None


class Writes:
    """One transfer's layers from queued to written (see the module doc); the sender's thread only."""

    def __init__(self, plan: Plan, checks: Checks, request_id: str) -> None:
        self.plan, self._checks, self.request_id = plan, checks, request_id
        self.ahead: collections.deque[Queued] = collections.deque()
        self.pending: list[Posted] = []

    def queue(self, layer: PoolLayer) -> None:
        self.ahead.append(Queued(layer))

    def ready(self, deadline: float, alive: Callable[[], bool]) -> Queued:
        """The first queued layer with its slot and checks (raising what its checks raised); the layers behind it
        handed to the checker thread while the arena has room for their slots."""
        cur = self.ahead[0]
        if self.plan.gathers and cur.slot is None:
            cur.slot = self._slot(len(cur.layer.block_ids), deadline, alive)
        for behind in list(self.ahead)[1:]:
            if behind.checks is None:
                if self.plan.gathers and behind.slot is None:
                    behind.slot = staging().take(self.plan.slot_nbytes(len(behind.layer.block_ids)))
                    if behind.slot is None:
                        break
                behind.checks = checker().submit(self._checks, behind.layer, behind.slot)
        if cur.checks is None:
            cur.checks = Future()
            cur.checks.set_result(self._checks(cur.layer, cur.slot))
        cur.checks.result()  # NOTE: raises here, the layer still queued (`close` gives its slot back)
        return self.ahead.popleft()

    def _slot(self, n: int, deadline: float, alive: Callable[[], bool]) -> Slot:
        """A slot for a layer of `n` blocks; while the arena is full, this transfer's writes are driven."""
        while (slot := staging().take(self.plan.slot_nbytes(n))) is None:
            if not alive() or time.monotonic() > deadline:
                raise TransferError(f"nixl: the staging arena stayed full ({staging().nbytes >> 20} MiB, "
                                    "nixl_writes.MAX_BYTES)", self.request_id, retryable=True)
            self.progress()
            if not self.pending:
                time.sleep(POLL_S)
        return slot

    def posted(self, handle: Any, layer: Queued) -> None:
        """`layer`'s WRITE is posted: its slot stays taken until the write completed."""
        self.pending.append((handle, layer.layer.index, layer.slot))
        layer.slot = None

    def progress(self) -> None:
        """Drive NIXL once; completed writes leave `pending` (their slots given back); a failed one fails the
        transfer."""
        nx = agent().nixl
        for item in list(self.pending):
            handle, layer, slot = item
            try:
                state = nx.check_xfer_state(handle)
            except Exception:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: the receiver's process is gone
                state = "ERR"
            if state == "PROC":
                continue
            self.pending.remove(item)
            nx.release_xfer_handle(handle)
            if slot is not None:
                staging().give(slot)
            if state == "ERR":
                raise TransferError(f"nixl: write of layer {layer} failed (receiver gone?)", self.request_id,
                                    retryable=True)

    def drain(self, until: float) -> bool:
        """Wait for the posted writes until `until`; True if some did not complete (the peer must be dropped).

        NOTE: the slots of writes still pending then are never given back: UCX may still be reading them."""
        while self.pending:
            try:
                self.progress()
            except TransferError:
                return True  # NOTE: a failed write: the connection to the peer is broken anyway
            if time.monotonic() > until:
                return True
            time.sleep(POLL_S)
        return False

    def close(self) -> None:
        """The layers never posted give their slots back."""
        while self.ahead:
            self.ahead.popleft().drop()
