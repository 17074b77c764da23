"""A CPU TP group's follower KV pools in shared memory, mapped by rank 0: the KV hand-off reads and writes each rank's
KV heads in that rank's own pool (engine/parallel/kv.py), with no hop through rank 0's sockets.

Why: through the followers' KV threads, every byte of a layer but rank 0's share crossed a pipe request and a gloo
send (TCP) and back. A 512-token SmolLM2 prompt at TP 3 took 15.1 ms to read and 50.4 ms to write that way, against
1.6 and 3.1 ms at TP 1 (BENCHMARKS.md, tensor parallelism). Mapped, a rank's heads move from the wire into the pool
of the rank that owns them, and out of the pool of the rank that holds them, with one memory copy.

Set-up (a collective over the group's TCPStore, once the ranks agreed on the pool's size: `agree_pool`):
1. rank 0 says whether the group shares its pools (`wanted`: CPU groups on Linux, unless PDCLUSTER_TP_KV=threads);
2. each follower makes the file rank 0 named for it in /dev/shm, the size of its pool (its space taken up front: a
   full tmpfs fails here, not with SIGBUS at a write), maps it as its pool in place of its private one (no request
   has used it yet), and gives the pool's shape in the store (or none: it could not make the file);
3. rank 0 maps every follower's file, says so, and unlinks them; so does each follower once told, or once its wait
   fails (the mappings stay: nothing is left in /dev/shm unless both a follower and rank 0 die in the set-up). If
   any follower gave no shape, rank 0 maps none and the whole group's hand-off goes through the followers' KV
   threads (`kv.KVService`), as before.

Why it is safe without a lock between the processes:
- a read comes from inside rank 0's forward, after the layer's all-reduces: every rank joins those only after its
  attention wrote the layer's K and V (and the all-reduce's own shared-memory counters order the bytes: x86);
- a write lands in blocks reserved for a transfer, which no step reads before the commit; the commit reaches a
  follower as a step message (a pipe write and read: a system call on each side) after the write returned;
- a follower that died leaves its mapping valid in rank 0: rank 0 checks its followers' pids before each read and
  write (`TPModelRunner`), which fails them as the closed sockets did.

Not on CUDA: the same idea there is CUDA IPC handles of the followers' pools (device-to-device over NVLink); not
built, as no machine with several GPUs was lent to run it. On CUDA the followers' KV threads carry the hand-off.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import uuid

import torch

from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup

log = logging.getLogger(__name__)
ENV = "PDCLUSTER_TP_KV"  # "threads": the hand-off through the followers' KV threads (the bench's comparison)


def wanted(device: torch.device) -> bool:
    """Whether a group on `device` shares its followers' pools: CPU groups on Linux, unless PDCLUSTER_TP_KV=threads."""
    choice = os.environ.get(ENV, "shared")
    if choice not in ("shared", "threads"):
        raise ValueError(f"{ENV} must be 'shared' or 'threads', got {choice!r}")
    return choice == "shared" and device.type == "cpu" and sys.platform.startswith("linux")


def share_pool(runner: ModelRunner, group: TPGroup) -> None:
    """A follower's side: its pool in a /dev/shm file for rank 0 to map, when rank 0 wants it (a collective)."""
    store = group.store
    base = store.get("kvpool/base").decode()
    if not base:
        return
    key, path = f"kvpool/{group.rank}", f"{base}-{group.rank}"
    shape, dtype = tuple(runner.kv.shape), runner.kv.dtype
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, math.prod(shape) * dtype.itemsize)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("TP rank %d: the KV hand-off goes through the KV threads: no shared memory for the pool "
                        "(%s)", group.rank, e)
            store.set(key, "")
            return
        del runner.kv, runner.kv_caches  # NOTE: the private pool's memory goes back before the file's is touched
        runner.use_kv(_map(path, shape, dtype))  # NOTE: the file's pages read as zeros, as the pool's did
        store.set(key, json.dumps(shape))
        store.wait(["kvpool/mapped"], datetime.timedelta(seconds=group.timeout_s))
    finally:
        _unlink(path)  # NOTE: rank 0 unlinks it too (whichever comes first): a rank killed here leaves nothing


def map_pools(runner: ModelRunner, group: TPGroup) -> dict[int, torch.Tensor] | None:
    """Rank 0's side: every follower's pool (rank → its KV tensor, as its runner holds it), or None where the group
    does not share them (not `wanted`, or a follower could not) (a collective)."""
    store = group.store
    if not wanted(runner.device):
        store.set("kvpool/base", "")
        return None
    base = f"/dev/shm/pdcluster-tp-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store.set("kvpool/base", base)
    try:
        shapes = {r: store.get(f"kvpool/{r}").decode() for r in range(1, group.size)}
        if not all(shapes.values()):
            return None  # NOTE: that follower logged why
        pools = {r: _map(f"{base}-{r}", tuple(json.loads(shape)), runner.kv.dtype) for r, shape in shapes.items()}
        log.info("TP group of %d: the KV hand-off reads and writes the followers' pools in place (shared memory)",
                 group.size)
        return pools
    finally:
        store.set("kvpool/mapped", "1")  # NOTE: always: the followers unlink their files once it is set
        for r in range(1, group.size):
            _unlink(f"{base}-{r}")


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
