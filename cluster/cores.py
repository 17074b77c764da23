"""Core lending: the CPU workers of one node lend their cores to a busy peer while they are idle.

Each worker computes on its own cores with its own torch threads (a pool's `cpu_affinity`, `torch_threads`). When
its peers on the node have nothing to do, a worker of a pool with `lend_idle_cores` runs its steps on their cores
too, with a thread per borrowed core, and drops back to its own share at its next step once a peer has work.

Life of a worker's share:
1. `CoreShare.join` claims a slot in a small file in /dev/shm named by the cluster (one per node: every worker of
   the cluster on this host opens the same file), writing its pid, own cores and threads, under a file lock;
   slots of dead processes are reclaimed;
2. before each engine step, on the engine loop's thread, `before_step()` marks this worker busy (one byte in the
   mapped file) and, when it lends and the step has at least `min_tokens` of prompt work left (short work ran
   slower on borrowed cores), reads every slot and applies `plan()`: torch threads, and the cores of every thread
   of this process (idle OpenMP threads sleep: OMP_WAIT_POLICY=PASSIVE, pdcluster/launch_actors.py); otherwise its own;
3. when the loop runs out of work, `idle()` marks it idle (the peers read that before their next step) and puts
   it back on its own cores and threads;
4. `leave()` frees the slot and removes the file after the node's last worker (a killed worker's slot is reclaimed
   by the next `join`, and a dead peer never counts as busy).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
from dataclasses import dataclass

from cluster.process import pin_cpus

log = logging.getLogger(__name__)

SHARE_DIR = "/dev/shm"
MAX_SLOTS = 32  # workers of one cluster on one node
_SLOT = struct.Struct("<iiQB")  # pid (0: free), own threads, own cores (bitmask; 0: not pinned), busy
_SLOT_BYTES = 32
_BUSY_OFFSET = _SLOT.size - 1  # the busy byte inside a slot: its last field (after pid, threads, cores)
# NOTE: a step borrows only with this much prompt work left (a pool's lend_min_prompt_tokens). In the 1P+1D cluster
# of deploy/bench-disagg.yaml on 2 cores, one prompt at a time on an idle cluster, the prefill worker's time to a
# first token with lending on / off: 71 tokens 141-199 / 101-108 ms, 120 tokens 218-295 / 160-168 ms, 256 tokens
# 313-344 / 344-372 ms, 512 tokens 584-665 / 710-817 ms (BENCHMARKS.md, issue 29). Decode-only steps gained
# nothing from a second thread either (ITL p50 24 lent against 22 ms not).
LEND_MIN_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class Slot:
    """One worker of the node as its peers see it."""

    pid: int
    threads: int  # its own torch threads
    cores: frozenset[int]  # its own cores (empty: not pinned)
    busy: bool


@dataclass(frozen=True)
class Share:
    """What a worker may compute on for its next step."""

    threads: int
    cores: frozenset[int]  # empty: not pinned (only the thread count changes)


def group_name(key_prefix: str, cluster_token: str) -> str:
    """The share file's name for one cluster: its workers on a node share it, other clusters' workers never do."""
    digest = hashlib.sha256(f"{key_prefix}\0{cluster_token}".encode()).hexdigest()[:16]
    return f"pdcluster-cores-{digest}"


def plan(me: int, slots: dict[int, Slot]) -> Share:
    """The threads and cores of worker `me` (a slot index) for its next step, given every slot of the node.

    The cores of the idle workers that no busy worker owns are dealt round-robin to the busy workers (in slot
    order; `me` counts as busy), one more thread each; an unpinned idle worker lends its thread count instead.
    """
    own = slots[me]
    busy = sorted(i for i, s in slots.items() if s.busy or i == me)
    idle = [s for i, s in sorted(slots.items()) if i not in busy]
    k, n = busy.index(me), len(busy)
    if not own.cores:
        spare = sum(s.threads for s in idle)
        return Share(own.threads + spare // n + (k < spare % n), frozenset())
    taken = frozenset().union(*(slots[i].cores for i in busy))
    free = sorted(frozenset().union(*(s.cores for s in idle)) - taken)
    extra = free[k::n]
    return Share(own.threads + len(extra), own.cores | frozenset(extra))


def _mask(cores: frozenset[int]) -> int:
    return sum(1 << c for c in cores)


def _cores(mask: int) -> frozenset[int]:
    return frozenset(c for c in range(64) if mask >> c & 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CoreShare:
    """This worker's slot in the node's share file; `before_step`/`idle` are called by its engine loop."""

    def __init__(self, path: str, index: int, fd: int, buf: mmap.mmap, own: Share, *, lend: bool,
                 min_tokens: int = LEND_MIN_PROMPT_TOKENS) -> None:
        self.path, self.index, self._fd, self._buf = path, index, fd, buf
        self.own = own
        self.lend = lend
        self.min_tokens = min_tokens  # prompt tokens left to compute for a step to borrow
        self.current = own  # what the last step ran with
        self.lent_steps = 0  # steps run on more than the own share
        self._busy = False

    @classmethod
    def join(cls, group: str, cores: tuple[int, ...], threads: int, *, lend: bool,
             min_tokens: int = LEND_MIN_PROMPT_TOKENS, directory: str = SHARE_DIR) -> CoreShare:
        """Claim a slot in the share file of `group` on this node (created if missing)."""
        if threads <= 0:
            raise ValueError(f"torch_threads: must be > 0, got {threads}")
        if any(c >= 64 for c in cores):
            raise ValueError(f"cpu_affinity: core lending handles cores 0-63, got {sorted(cores)}")
        path = os.path.join(directory, group)
        fd = cls._open_locked(path)
        try:
            try:
                if os.fstat(fd).st_size < MAX_SLOTS * _SLOT_BYTES:
                    os.ftruncate(fd, MAX_SLOTS * _SLOT_BYTES)
                buf = mmap.mmap(fd, MAX_SLOTS * _SLOT_BYTES)
                index = cls._claim(buf, cores, threads)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, index, fd, buf, Share(threads, frozenset(cores)), lend=lend, min_tokens=min_tokens)

    @staticmethod
    def _open_locked(path: str) -> int:
        """The share file, created if missing, locked; never one the node's last worker has just removed."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # NOTE: unlinked by `leave` while we waited for the lock: open the new one

    @staticmethod
    def _claim(buf: mmap.mmap, cores: tuple[int, ...], threads: int) -> int:
        for i in range(MAX_SLOTS):
            pid = _SLOT.unpack_from(buf, i * _SLOT_BYTES)[0]
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(buf, i * _SLOT_BYTES, os.getpid(), threads, _mask(frozenset(cores)), 0)
                return i
        raise RuntimeError(f"lend_idle_cores: more than {MAX_SLOTS} workers of this cluster on this node")

    def slots(self) -> dict[int, Slot]:
        """Every live worker of the node (this one included)."""
        out: dict[int, Slot] = {}
        for i in range(MAX_SLOTS):
            pid, threads, mask, busy = _SLOT.unpack_from(self._buf, i * _SLOT_BYTES)
            # NOTE: a worker killed while busy must not hold its cores forever: its pid is gone
            if pid and (i == self.index or _alive(pid)):
                out[i] = Slot(pid, threads, _cores(mask), bool(busy))
        return out

    def _mark(self, busy: bool) -> None:
        if self._busy != busy:
            self._buf[self.index * _SLOT_BYTES + _BUSY_OFFSET] = int(busy)
            self._busy = busy

    def before_step(self, prompt_tokens: int) -> Share:
        """Mark this worker busy and, when it lends and the step has `prompt_tokens` >= `min_tokens` of prompt work
        left, take the share `plan` gives it, else its own (on the stepping thread)."""
        self._mark(True)
        if not self.lend:
            return self.current
        share = plan(self.index, self.slots()) if prompt_tokens >= self.min_tokens else self.own
        if share != self.current:
            self._apply(share)
        if share.threads > self.own.threads:
            self.lent_steps += 1
        return share

    def _apply(self, share: Share) -> None:
        import torch

        # NOTE: widen the cores before adding threads, narrow them after dropping threads: no moment with more
        # threads than cores. torch.set_num_threads sets this thread's OpenMP pool size (~0.1 us).
        if share.cores and len(share.cores) >= len(self.current.cores):
            pin_cpus(tuple(sorted(share.cores)))
        torch.set_num_threads(share.threads)
        if share.cores and len(share.cores) < len(self.current.cores):
            pin_cpus(tuple(sorted(share.cores)))
        self.current = share

    def idle(self) -> None:
        """This worker has no work: its peers may use its cores from their next step; it keeps only its own."""
        self._mark(False)
        if self.current != self.own:
            # NOTE: on the loop thread, like before_step: an idle worker holds no core it borrowed
            self._apply(self.own)

    def leave(self) -> None:
        """Free the slot (the worker is closing)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            _SLOT.pack_into(self._buf, self.index * _SLOT_BYTES, 0, 0, 0, 0)
            if not any(_SLOT.unpack_from(self._buf, i * _SLOT_BYTES)[0] for i in range(MAX_SLOTS)):
                os.unlink(self.path)  # NOTE: the last worker of the cluster on this node: nothing left in /dev/shm
            self._buf.close()
        finally:
            os.close(self._fd)
