"""This process's NIXL agent: one per process, made on first use, shared by every nixl sender and receiver here.

What the transport needs of NIXL, in one place:
- `load()`: the NIXL Python package (`nixl_cu13`, `nixl_cu12` or `nixl`, whichever is installed), or ImportError
  saying why not; the UCX defaults below are set first (an environment variable the user set wins);
- `Agent`: the agent, made without NIXL's progress thread (it polls with delay 0 and burns a core per agent even
  when idle): progress is driven by whoever waits (the sender's thread while its writes are in flight, the
  receiver's notification thread while a transfer is open), and the agent is thread safe (`STRICT`);
- `Agent.pool`: a KV tensor ([layers, 2, num_blocks, *block_shape]) registered once, with its descriptor list
  prepared once (descriptor index = (layer * 2 + kv) * num_blocks + block);
- `Agent.peer`: a remote agent's metadata loaded once per agent name (a new name means the peer restarted) and the
  remote pool's descriptor list prepared once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.transports import cuda_ipc
from kv_transfer.transports.nixl_load import load

log = logging.getLogger(__name__)

_agent: Agent | None = None
_lock = threading.Lock()


def ucx_lanes(lines: Iterable[str]) -> list[str]:
    """The endpoint configurations in UCX's log lines at info level (UCX_LOG_LEVEL=info), from the agent on, e.g.
    `b intra-node cfg#1 rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)` between two host pools:
    what carried the bytes, cuda_ipc or a copy through the host."""
    return [line.split("INFO", 1)[-1].strip()[:240] for line in lines if "cfg#" in line and "INFO" in line]


def agent() -> Agent:
    """This process's agent (made on first use)."""
    global _agent
    with _lock:
        if _agent is None:
            _agent = Agent(f"pdc-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return _agent


def mem_type(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor's memory."""
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def block_descs(addr: int, num_regions: int, num_blocks: int, block_nbytes: int, device: int) -> np.ndarray:
    """[num_regions * num_blocks, 3] (address, length, device) of every block of a pool laid out region-major."""
    idx = np.arange(num_regions * num_blocks, dtype=np.uint64)
    out = np.empty((len(idx), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(addr) + idx * np.uint64(block_nbytes)
    out[:, 1] = block_nbytes
    out[:, 2] = device
    return out


def runs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs in which both block id lists go up by one together: (local starts, remote starts, lengths)."""
    if len(local) == 0:
        return local[:0], remote[:0], np.zeros(0, dtype=np.int64)
    cut = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate(([0], cut))
    return local[starts], remote[starts], np.diff(np.concatenate((starts, [len(local)])))


def run_descs(addr: int, num_blocks: int, block_nbytes: int, device: int, layer: int, starts: np.ndarray,
              lengths: np.ndarray) -> np.ndarray:
    """[2 * runs, 3] (address, length, device) of runs of blocks in a layer's K region, then the same in its V."""
    out = np.empty((2 * len(starts), 3), dtype=np.uint64)
    for which in (0, 1):
        rows = out[which * len(starts):(which + 1) * len(starts)]
        first = (layer * 2 + which) * num_blocks + starts.astype(np.uint64)
        rows[:, 0] = np.uint64(addr) + first * np.uint64(block_nbytes)
        rows[:, 1] = lengths.astype(np.uint64) * np.uint64(block_nbytes)
        rows[:, 2] = device
    return out


@dataclass
class Pool:
    """A registered KV pool, one tensor per TP rank (rank 0 first; one at TP 1), each [layers, 2, num_blocks,
    *block_shape] holding that rank's KV heads, and its prepared local descriptor list."""

    kvs: list[torch.Tensor]
    mem: str  # "DRAM" | "VRAM"
    device: int
    num_blocks: int
    block_nbytes: int  # per rank's block
    dlist: Any  # prepared handle; descriptor ((rank * layers + layer) * 2 + kv) * num_blocks + block

    @property
    def kv(self) -> torch.Tensor:
        """Rank 0's tensor (the only one at TP 1)."""
        return self.kvs[0]


@dataclass
class Peer:
    """A remote agent and its pool, as a sender writes into it."""

    name: str
    num_blocks: int
    dlist: Any  # prepared handle over the remote pool, indexed like `Pool.dlist`
    addrs: list[int] = field(default_factory=list)  # the remote pool per rank, rank 0 first (`Agent.write` describes
    block_nbytes: int = 0  # runs of them), its block size and memory
    mem: str = "DRAM"
    device: int = 0


class Agent:
    """One NIXL agent (UCX backend, no progress thread) and what it registered and learnt."""

    def __init__(self, name: str) -> None:
        nixl = load()
        conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                      sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self.nixl = nixl.nixl_agent(name, conf)
        self._pools: dict[int, Pool] = {}
        self._peers: dict[tuple[str, int], Peer] = {}
        self._lock = threading.Lock()

    @property
    def metadata(self) -> bytes:
        return bytes(self.nixl.get_agent_metadata())

    def pool(self, kv: torch.Tensor | list[torch.Tensor]) -> Pool:
        """`kv` (a pool, or one per TP rank, rank 0 first) registered with NIXL (once per pool) with its local
        descriptor list."""
        kvs = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        with self._lock:
            pool = self._pools.get(kvs[0].data_ptr())
            if pool is None:
                for t in kvs:
                    assert t.is_contiguous() and t.dim() >= 4 and t.shape == kvs[0].shape
                mem, dev = mem_type(kvs[0])
                layers, _, n = kvs[0].shape[:3]
                block_nbytes = kvs[0][0, 0, 0].numel() * kvs[0].element_size()
                self.nixl.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "") for t in kvs], mem)
                descs = np.concatenate([block_descs(t.data_ptr(), layers * 2, n, block_nbytes, dev) for t in kvs])
                pool = self._pools[kvs[0].data_ptr()] = Pool(kvs, mem, dev, n, block_nbytes,
                                                             self.nixl.prep_xfer_dlist("", descs, mem))
            return pool

    def peer(self, name: str, metadata: bytes, addr: int, num_regions: int, num_blocks: int, block_nbytes: int,
             mem: str, device: int, shard_addrs: Sequence[int] = ()) -> Peer:
        """The remote agent `name`'s pool at `addr` (its ranks 1 .. n-1 at `shard_addrs`, for a TP group's pool; its
        metadata loaded once: `metadata` may be empty then)."""
        with self._lock:
            peer = self._peers.get((name, addr))
            if peer is None:
                # NOTE: a receiver in this same process is written by loopback (no metadata to load)
                if name != self.name and not any(p.name == name for p in self._peers.values()):
                    if not metadata:
                        raise KeyError(name)
                    loaded = self.nixl.add_remote_agent(metadata)
                    loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                    assert loaded == name, (loaded, name)
                addrs = [addr, *shard_addrs]
                descs = np.concatenate([block_descs(a, num_regions, num_blocks, block_nbytes, device) for a in addrs])
                peer = self._peers[(name, addr)] = Peer(name, num_blocks, self.nixl.prep_xfer_dlist(name, descs, mem),
                                                        addrs, block_nbytes, mem, device)
            return peer

    def write(self, pool: Pool, peer: Peer, layer: int, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        """A WRITE (not yet posted) of one layer's K and V blocks `local` into the peer's blocks `remote`, with
        `notif`: one descriptor per run of consecutive blocks on both sides, per rank (rank r's pool into the
        peer's rank r's).

        NOTE: the prepared per-block lists would give UCX one copy per block (a 12 KiB block of SmolLM2's pool):
        7 GB/s against 10.6 for the same 94 MB in runs, in huge pages (BENCHMARKS.md, issue 30).
        """
        assert len(pool.kvs) == len(peer.addrs), (len(pool.kvs), len(peer.addrs))
        ls, rs, n = runs(local, remote)
        src = np.concatenate([run_descs(t.data_ptr(), pool.num_blocks, pool.block_nbytes, pool.device, layer, ls, n)
                              for t in pool.kvs])
        dst = np.concatenate([run_descs(a, peer.num_blocks, peer.block_nbytes, peer.device, layer, rs, n)
                              for a in peer.addrs])
        return self.post(pool.mem, peer, src, dst, notif)

    def post(self, mem: str, peer: Peer, src: np.ndarray, dst: np.ndarray, notif: bytes) -> Any:
        """A WRITE (not yet posted) of local descriptors `src` (in memory `mem`) into the peer's `dst` (each
        [rows, 3]: address, length, device; row i into row i), with `notif`."""
        nx = self.nixl
        return nx.initialize_xfer("WRITE", nx.get_xfer_descs(src, mem), nx.get_xfer_descs(dst, peer.mem), peer.name,
                                  notif)

    def register_host(self, mem: torch.Tensor) -> None:
        """Host memory registered for the life of the process (the nixl sender's staging arena, nixl_reshard.py)."""
        self.nixl.register_memory([(mem.data_ptr(), mem.numel() * mem.element_size(), 0, "")], "DRAM")

    def knows(self, name: str) -> bool:
        with self._lock:
            return name == self.name or any(p.name == name for p in self._peers.values())

    def forget(self, name: str) -> None:
        """Drop a peer (it restarted or stopped answering): its metadata, its lists, the connection to it."""
        with self._lock:
            gone = [key for key, p in self._peers.items() if p.name == name]
            for key in gone:
                # NOTE: the prepared list is not released: a sender of another transfer may still hold it (its
                # next post fails on the dropped agent, it does not touch freed memory)
                self._peers.pop(key)
        cuda_ipc.forget(name)
        if gone and name != self.name:
            try:
                self.nixl.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - a peer already gone may refuse; nothing else to undo
                log.debug("forgetting NIXL peer %s: %s", name, e)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name (also drives this agent's progress)."""
        got = self.nixl.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in got.items()}
