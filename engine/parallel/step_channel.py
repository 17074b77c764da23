"""Rank 0's step messages to the followers of a TP group through one pipe per follower (a FIFO in /dev/shm).

A gloo broadcast costs ~0.2 ms per step here (a hand-off to gloo's thread on every rank and a TCP round trip), a
sixth of a TP 2 `tiny` decode step; a step of a 70B model on GPUs is a few ms, so the same cost would matter there
too. vLLM sends its step to the workers through shared memory (its MessageQueue) for the same reason. A pipe is a
write by rank 0 and a read by each follower, and it keeps what gloo gave for free:
- a follower blocks in its read while the engine idles, for hours if need be, without spinning;
- a rank 0 that dies closes its ends: the follower's read gets end-of-file at once and it leaves (RuntimeError);
- a follower that dies closes its end: rank 0's next write fails with EPIPE at once (RuntimeError, as a closed
  gloo socket), and a follower that hangs without dying fails rank 0's write once its pipe stays full past the
  group's timeout (a step message is a few KB and the followers are at most one message behind, so a pipe fills
  only behind a stopped follower).

Set-up (a collective over the group's TCPStore, like the shared-memory all-reduce's): rank 0 makes one FIFO per
follower and names them in the store; each follower opens its own for reading (non-blocking, so it needs no writer
yet) and says so; rank 0 opens each for writing once all have, unlinks the names (nothing is left behind however
the ranks end) and tells the followers, who may read from then on (a FIFO read before any writer opened it would
see end-of-file). A frame is the pickled message's length (8 bytes) then its bytes.

Where it is not used (the group's step messages then go over gloo, as before): hosts other than Linux, and
`PDCLUSTER_TP_STEP_CHANNEL=gloo` (the bench's comparison). The ranks of a group share one node (a worker's placement
group is STRICT_PACK), so the FIFOs reach every rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import sys
import time
import uuid
from typing import Any

from engine.parallel.store import wait_count

log = logging.getLogger(__name__)
ENV = "PDCLUSTER_TP_STEP_CHANNEL"  # "gloo": step messages over gloo's broadcast instead
HEADER = 8  # bytes of a frame's length


def wanted() -> bool:
    """Whether a group sends its step messages through pipes: on Linux, unless PDCLUSTER_TP_STEP_CHANNEL=gloo."""
    choice = os.environ.get(ENV, "pipe")
    if choice not in ("pipe", "gloo"):
        raise ValueError(f"{ENV} must be 'pipe' or 'gloo', got {choice!r}")
    return choice == "pipe" and sys.platform.startswith("linux")


class StepChannel:
    """One rank's end of the group's step pipes: rank 0 `send`s, a follower `recv`s (see the module docstring)."""

    def __init__(self, rank: int, size: int, fds: list[int], timeout_s: float) -> None:
        self.rank, self.size, self.fds, self.timeout_s = rank, size, fds, timeout_s  # rank 0: one per follower

    @classmethod
    def join(cls, rank: int, size: int, store: Any, timeout_s: float, name: str = "steps") -> StepChannel | None:
        """Every rank's end of the channel `name` (a collective over `store`; RuntimeError when a rank does not come
        within `timeout_s`); None on every rank when rank 0 could not make the FIFOs (the messages go over gloo
        then, as logged)."""
        if rank == 0:
            base = f"/dev/shm/pdcluster-tp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            paths = [f"{base}-{r}" for r in range(1, size)]
            try:
                for p in paths:
                    os.mkfifo(p, 0o600)
            except OSError as e:
                for p in paths:
                    if os.path.exists(p):
                        os.unlink(p)
                log.warning("TP %s messages over gloo: no FIFO for them (%s)", name, e)
                store.set(f"{name}/path", "")
                return None
            try:
                store.set(f"{name}/path", base)
                wait_count(store, f"{name}/attached", size - 1, timeout_s,
                           f"TP {name} channel: {size - 1} followers did not all open their pipes")
                # NOTE: every reader is open, so these opens do not block; non-blocking writes, bounded by `send`
                fds = [os.open(p, os.O_WRONLY | os.O_NONBLOCK) for p in paths]
            finally:
                for p in paths:
                    os.unlink(p)
            store.set(f"{name}/open", "1")
            return cls(0, size, fds, timeout_s)
        base = store.get(f"{name}/path").decode()
        if not base:
            return None
        fd = os.open(f"{base}-{rank}", os.O_RDONLY | os.O_NONBLOCK)
        store.add(f"{name}/attached", 1)
        store.get(f"{name}/open")  # NOTE: waits for rank 0's writers (a read before them would see end-of-file)
        os.set_blocking(fd, True)
        return cls(rank, size, [fd], timeout_s)

    def send(self, obj: object) -> None:
        """Rank 0: `obj` to every follower (RuntimeError if one is gone, or hung past the timeout)."""
        if not self.fds:
            raise RuntimeError("TP step channel: closed")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame = memoryview(len(data).to_bytes(HEADER, "little") + data)
        for r, fd in enumerate(self.fds, start=1):
            self._write(r, fd, frame)

    def _write(self, rank: int, fd: int, frame: memoryview) -> None:
        deadline = None
        while frame:
            try:
                frame = frame[os.write(fd, frame):]
                continue
            except BlockingIOError:
                pass  # NOTE: the pipe is full: wait for the follower to read, up to the timeout
            except BrokenPipeError as e:
                raise RuntimeError(f"TP step channel: rank {rank} is gone (its pipe is closed)") from e
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                raise RuntimeError(f"TP step channel: rank {rank} read nothing for {self.timeout_s:.0f} s")
            select.select([], [fd], [], min(1.0, deadline - now))

    def recv(self) -> Any:
        """A follower: rank 0's next message, as long as the engine idles (RuntimeError once rank 0 is gone)."""
        length = int.from_bytes(self._read(HEADER), "little")
        return pickle.loads(self._read(length))

    def _read(self, n: int) -> bytes:
        if not self.fds:
            raise RuntimeError("TP step channel: closed")
        fd, parts = self.fds[0], []
        while n:
            part = os.read(fd, n)
            if not part:
                raise RuntimeError("TP step channel: rank 0 is gone (its pipe is closed)")
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    def close(self) -> None:
        """Close this rank's ends (rank 0's: the followers' next read sees end-of-file)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

