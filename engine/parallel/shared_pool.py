"""A CPU TP group's follower KV pools in shared memory, mapped by rank 0: the KV hand-off reads and writes each rank's
KV heads in that rank's own pool (engine/parallel/kv.py), with no hop through rank 0's sockets.

Why: through the followers' KV threads, every byte of a layer but rank 0's share crossed a pipe request and a gloo
send (TCP) and back. A 512-token SmolLM2 prompt at TP 3 took 15.1 ms to read and 50.4 ms to write that way, against
1.6 and 3.1 ms at TP 1 (BENCHMARKS.md, tensor parallelism). Mapped, a rank's heads move from the wire into the pool
of the rank that owns them, and out of the pool of the rank that holds them, with one memory copy.

Set-up (a collective over the group's TCPStore, once the ranks agreed on the pool's size: `agree_pool`):
1. rank 0 says whether the group shares its pools (`wanted`: CPU groups on Linux, unless PDCLUSTER_TP_KV=threads);
2. each follower makes an anonymous shared-memory file the size of its pool (`memfd_create`: no name anywhere, not
   bounded by a container's small /dev/shm; its space taken up front, so a full memory fails here, not with SIGBUS
   at a write), maps it as its pool in place of its private one (no request has used it yet), and gives its pid,
   descriptor and the pool's shape in the store (or nothing: it could not make the file);
3. rank 0 opens each follower's file through /proc/<pid>/fd/<fd> (the ranks of a group share a node and a user),
   maps it, and says so; each follower then closes its descriptor. The memory lives as long as a mapping of it: it
   goes with the last of the follower's process and rank 0's pools, however they end. If any follower gave nothing,
   or rank 0 cannot open one, rank 0 maps none and the whole group's hand-off goes through the followers' KV
   threads (`kv.KVService`), as before.

Why it is safe without a lock between the processes:
- a read comes from inside rank 0's forward, after the layer's all-reduces: every rank joins those only after its
  attention wrote the layer's K and V (and the all-reduce's own shared-memory counters order the bytes: x86);
- a write lands in blocks reserved for a transfer, which no step reads before the commit; the commit reaches a
  follower as a step message (a pipe write and read: a system call on each side) after the write returned;
- a follower that died leaves its mapping valid in rank 0: rank 0 checks its followers' pids before each read and
  write (`TPModelRunner`), which fails them as the closed sockets did.

Not on CUDA: the same idea there is CUDA IPC handles of the followers' pools (device to device over NVLink). Rank 0
cannot open them as the ranks run now (each rank actor sees only its own GPU: Ray sets CUDA_VISIBLE_DEVICES per
actor; vLLM makes every GPU of the node visible to each worker for this), and no machine with several GPUs was lent
to build it on. On CUDA the followers' KV threads carry the hand-off.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
from typing import Any

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
    """A follower's side: its pool in an anonymous shared file for rank 0 to map, when rank 0 wants it (a
    collective)."""
    store = group.store
    if store.get("kvpool/wanted") != b"1":
        return
    key = f"kvpool/{group.rank}"
    shape, dtype = tuple(runner.kv.shape), runner.kv.dtype
    try:
        fd = os.memfd_create(f"pdcluster-tp-kv-{group.rank}", os.MFD_CLOEXEC)
    except OSError as e:
        return _without(store, key, group.rank, e)
    try:
        try:
            os.posix_fallocate(fd, 0, math.prod(shape) * dtype.itemsize)
        except OSError as e:
            return _without(store, key, group.rank, e)
        del runner.kv, runner.kv_caches  # NOTE: the private pool's memory goes back before the file's is touched
        runner.use_kv(_map(f"/proc/self/fd/{fd}", shape, dtype))  # NOTE: its pages read as zeros, as the pool's did
        store.set(key, json.dumps({"pid": os.getpid(), "fd": fd, "shape": shape}))
        store.wait(["kvpool/mapped"], datetime.timedelta(seconds=group.timeout_s))
    finally:
        os.close(fd)  # NOTE: the mappings keep the memory


def map_pools(runner: ModelRunner, group: TPGroup) -> dict[int, torch.Tensor] | None:
    """Rank 0's side: every follower's pool (rank → its KV tensor, as its runner holds it), or None where the group
    does not share them (not `wanted`, or a follower could not) (a collective)."""
    store = group.store
    want = wanted(runner.device)
    store.set("kvpool/wanted", "1" if want else "0")
    if not want:
        return None
    try:
        specs = {r: store.get(f"kvpool/{r}").decode() for r in range(1, group.size)}
        if not all(specs.values()):
            return None  # NOTE: that follower logged why
        pools = {}
        for r, text in specs.items():
            spec = json.loads(text)
            pools[r] = _map(f"/proc/{spec['pid']}/fd/{spec['fd']}", tuple(spec["shape"]), runner.kv.dtype)
    except OSError as e:
        log.warning("TP group of %d: the KV hand-off goes through the KV threads: a follower's pool cannot be "
                    "mapped here (%s)", group.size, e)
        return None
    finally:
        store.set("kvpool/mapped", "1")  # NOTE: always: the followers close their descriptors once it is set
    log.info("TP group of %d: the KV hand-off reads and writes the followers' pools in place (shared memory)",
             group.size)
    return pools


def _without(store: Any, key: str, rank: int, error: OSError) -> None:
    log.warning("TP rank %d: the KV hand-off goes through the KV threads: no shared memory for the pool (%s)", rank,
                error)
    store.set(key, "")


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
