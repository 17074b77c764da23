"""A TP group's KV in the full model's layout: what the KV hand-off reads from and writes into a group's ranks.

Each rank's pool holds its KV heads (`shard.kv_heads_of`) of every block; a peer engine, whatever its own TP size,
sees one engine with all the model's KV heads (its `kv_layout`), so prefill TP a → decode TP b needs nothing of the
transports. Rank 0 (`KVGather`) answers the seam's `read_blocks` / `write_blocks` one of two ways:
- **in place** (CPU groups, the default: engine/parallel/shared_pool.py): the followers' pools live in shared
  memory that rank 0 maps, so a read copies each rank's heads out of that rank's pool and a write copies each rank's
  heads into it, with no message to the follower (the transport's bytes go straight between the wire and the pool
  of the rank that owns them);
- **through the followers' KV threads** (CUDA, and PDCLUSTER_TP_KV=threads or memory that cannot be shared),
  on the group's KV channel (`TPGroup.kv`, gloo on the CPU):
  1. rank 0 sends the request (`ReadKV` or `WriteKV`: layer, K/V, block ids) to every follower's KV thread (a pipe
     each, `TPGroup.kv_request`; gloo's broadcast where there are none);
  2. a read: each follower holding a KV head no lower rank holds sends its K and V of the blocks (one tensor,
     [2, n, rows, h, D]); rank 0 puts every head in model order (replicated heads taken once, from the first rank
     holding them);
  3. a write: rank 0 sends each follower its heads' slice (replicas each get theirs), writes its own meanwhile, and
     waits for every follower's acknowledgement (the blocks are written before the seam's commit can schedule them);
  4. `StopKV` ends a KV thread (`TPModelRunner.close`, before the step channel's `Stop`); a follower whose KV thread
     fails exits, so rank 0's next read or write fails at once (closed sockets), not after the group's timeout.

Choices (why):
- the threads' own group, not the step channel: reads come from inside a forward (rank 0's thread, while the
  followers' main threads wait in the next all-reduce) and writes from receiver threads while the engine steps; on
  one group they would interleave with the steps' collectives. A lock on rank 0 serializes the KV group's users (the
  in-place path needs none: reads and writes touch other blocks).
- point-to-point sends, not gather/scatter: a replicated head (n > KVH) is then read from one rank only.
- cost through the threads: every byte of a layer's K and V but rank 0's share goes through rank 0 (a read:
  (1 - 1/min(n, KVH)) of 2 x blocks x rows x KVH x D x itemsize per layer; a write: each follower's slice, replicas
  included), over TCP on the CPU, through host memory on CUDA (gloo is CPU only). In place it is one copy per rank's
  share (BENCHMARKS.md, tensor parallelism, session 16: a 512-token SmolLM2 prompt at TP 3, read 12.6-13.1 →
  3.7-3.8 ms, write 56-58 → 4.0-4.1 ms, against 1.6-2.0 and 2.9 at TP 1).
- int8 KV is sliced the same way: each head's per-block scale sits in that head's own column of the scale row.
- on CUDA, rank 0 synchronizes its device before asking for a layer: its all-reduce of that layer completed, so
  every rank's GPU ran that layer's KV write (stream order before its share of the all-reduce), even where a
  follower's host has not reached the hook's layer; the follower's KV thread then reads finished memory. A
  follower syncs its device after a write before it acknowledges. (Not run on CUDA yet: it needs a GPU per rank.)
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup
from engine.parallel.shard import kv_heads_of

log = logging.getLogger(__name__)

TAG_READ, TAG_WRITE, TAG_ACK = 1, 2, 3  # point-to-point tags on the KV group


@dataclass(slots=True)
class ReadKV:
    """Send rank 0 your K and V of `block_ids` in `layer` (ranks whose heads no lower rank holds)."""

    layer: int
    block_ids: list[int]


@dataclass(slots=True)
class WriteKV:
    """Receive your heads' slice of K (which=0) or V (1) of `block_ids` in `layer`, write it, acknowledge."""

    layer: int
    which: int
    block_ids: list[int]


@dataclass(slots=True)
class StopKV:
    """The group is closing: the KV thread leaves its loop."""


class KVChannelClosed(Exception):
    """A read or write after `KVGather.stop`: the group is closing or closed."""


def read_sources(cfg: ModelConfig, n: int) -> dict[int, range]:
    """The ranks a read takes KV heads from, each with its heads: every head once, from the first rank holding it."""
    seen: set[int] = set()
    out: dict[int, range] = {}
    for rank in range(n):
        heads = kv_heads_of(cfg, rank, n)
        if not seen.issuperset(heads):
            assert seen.isdisjoint(heads), "a rank holds some heads of a lower rank and some new ones"
            out[rank] = heads
            seen.update(heads)
    return out


def _sl(heads: range) -> slice:
    return slice(heads.start, heads.stop)


class KVGather:
    """Rank 0's side: a full-layout read or write of some blocks of one layer, over every rank's pool."""

    def __init__(self, runner: ModelRunner, group: TPGroup, cfg: ModelConfig,
                 pools: dict[int, torch.Tensor] | None = None) -> None:
        self.runner, self.group, self.cfg = runner, group, cfg  # `cfg`: the full model's
        n = group.size
        self.heads = [kv_heads_of(cfg, r, n) for r in range(n)]
        self.sources = read_sources(cfg, n)
        self.pools = pools  # the followers' pools mapped here (shared_pool.py), else None: through their KV threads
        self.lock = threading.Lock()  # NOTE: reads (engine thread) and writes (receiver threads) may overlap
        self.stopped = False  # under `lock`: the followers' KV threads have left

    def _buffer(self, lead: tuple[int, ...], heads: range) -> torch.Tensor:
        r = self.runner
        rows, d = r.kv.shape[3], self.cfg.head_dim
        return torch.empty(*lead, rows, len(heads), d, dtype=r.kv_dtype)  # on the host: gloo's tensors

    @torch.inference_mode()
    def read(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` in `layer` with every KV head: each [n, rows, KVH, D], on rank 0's device."""
        r, n = self.runner, len(block_ids)
        if self.pools is not None:
            return self._read_shared(layer, block_ids)  # NOTE: no lock (see `_shared`)
        with self.lock:
            self._check_open()
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)  # NOTE: see the module's docstring (every rank wrote the layer)
            self.group.kv_request(ReadKV(layer, list(block_ids)))
            bufs = {rank: self._buffer((2, n), heads) for rank, heads in self.sources.items() if rank}
            works = [self.group.kv.recv([buf], rank, TAG_READ) for rank, buf in bufs.items()]
            own_k, own_v = ModelRunner.read_blocks(r, layer, block_ids)  # [n, rows, h0, D] each, meanwhile
            k = torch.empty(n, own_k.shape[1], self.cfg.num_kv_heads, self.cfg.head_dim, dtype=r.kv_dtype,
                            device=r.device)  # [n, rows, KVH, D]
            v = torch.empty_like(k)
            k[:, :, _sl(self.heads[0])], v[:, :, _sl(self.heads[0])] = own_k, own_v
            for w in works:
                w.wait()
        for rank, buf in bufs.items():
            k[:, :, _sl(self.sources[rank])].copy_(buf[0])
            v[:, :, _sl(self.sources[rank])].copy_(buf[1])
        return k, v

    @torch.inference_mode()
    def write(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1) of every head, [n, rows, KVH, D], into `block_ids` of `layer` on every rank."""
        r = self.runner
        if self.pools is not None:
            return self._write_shared(layer, which, block_ids, kv)
        host = kv.to("cpu", r.kv_dtype)
        slices = {rank: host[:, :, _sl(self.heads[rank])].contiguous() for rank in range(1, self.group.size)}
        acks = {rank: torch.zeros(1, dtype=torch.uint8) for rank in slices}
        with self.lock:
            self._check_open()
            self.group.kv_request(WriteKV(layer, which, list(block_ids)))
            works = [self.group.kv.send([t], rank, TAG_WRITE) for rank, t in slices.items()]
            works += [self.group.kv.recv([t], rank, TAG_ACK) for rank, t in acks.items()]
            ModelRunner.write_blocks(r, layer, which, block_ids, kv[:, :, _sl(self.heads[0])])  # meanwhile
            for w in works:
                w.wait()

    def _read_shared(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` from the pools: each source rank's K and V heads copied out of its pool in one indexing."""
        r = self.runner
        idx = torch.tensor(block_ids, dtype=torch.long)
        kv = torch.empty(2, len(block_ids), r.kv.shape[3], self.cfg.num_kv_heads, self.cfg.head_dim, dtype=r.kv_dtype)
        pools = self._shared()
        for rank, heads in self.sources.items():
            kv[:, :, :, _sl(heads)] = (pools[rank] if rank else r.kv)[layer, :, idx]  # [2, n, rows, h, D]
        return kv[0], kv[1]

    def _write_shared(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """`write` into the pools: each rank's heads (replicas too) into its own pool."""
        r = self.runner
        idx = torch.tensor(block_ids, dtype=torch.long)
        kv = kv.to(r.device, r.kv_dtype)
        pools = self._shared()
        for rank, heads in enumerate(self.heads):
            (pools[rank] if rank else r.kv)[layer, which].index_copy_(0, idx, kv[:, :, _sl(heads)])

    def _shared(self) -> dict[int, torch.Tensor]:
        """The followers' mapped pools, held for one read or write (no lock: reads and writes touch other blocks,
        and `stop` only drops the group's own reference; KVChannelClosed after it)."""
        pools = self.pools
        self._check_open()
        assert pools is not None
        return pools

    def _check_open(self) -> None:
        if self.stopped:
            raise KVChannelClosed("the tensor-parallel group's KV channel is closed")

    def stop(self) -> None:
        """End the followers' KV threads (after the reads and writes in progress); later ones raise KVChannelClosed."""
        with self.lock:
            if not self.stopped:
                self.stopped = True
                self.pools = {} if self.pools is not None else None  # NOTE: the mappings go with the last view
                self.group.kv_request(StopKV())


class KVService:
    """A follower's side: a thread answering rank 0's KV requests on its pool (beside the steps' main thread)."""

    def __init__(self, runner: ModelRunner, group: TPGroup, cfg: ModelConfig) -> None:
        self.runner, self.group = runner, group
        self.heads = kv_heads_of(cfg, group.rank, group.size)
        self.sends = group.rank in read_sources(cfg, group.size)  # NOTE: a replica of a lower rank's heads: never
        self.thread = threading.Thread(target=self.run, name=f"tp-kv-rank-{group.rank}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @torch.inference_mode()
    def handle(self, msg: ReadKV | WriteKV | StopKV) -> bool:
        """Answer one request; False once it is `StopKV`."""
        r, pg = self.runner, self.group.kv
        if isinstance(msg, StopKV):
            return False
        with r.on_device():
            if isinstance(msg, ReadKV):
                if self.sends:
                    k, v = r.read_blocks(msg.layer, msg.block_ids)  # [n, rows, h, D] each
                    pg.send([torch.stack([k, v]).cpu()], 0, TAG_READ).wait()
                return True
            rows, d = r.kv.shape[3], r.cfg.head_dim
            buf = torch.empty(len(msg.block_ids), rows, len(self.heads), d, dtype=r.kv_dtype)
            pg.recv([buf], 0, TAG_WRITE).wait()
            r.write_blocks(msg.layer, msg.which, msg.block_ids, buf)
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)  # NOTE: written before rank 0 may commit and schedule them
            pg.send([torch.zeros(1, dtype=torch.uint8)], 0, TAG_ACK).wait()
        return True

    def run(self) -> None:
        """Answer requests until `StopKV`; a failure (rank 0 gone, or a bug) ends the process: the group is out."""
        msg: Any = None
        try:
            while self.handle(msg := self.group.kv_request()):
                pass
        except BaseException:
            log.error("TP rank %d: the KV thread failed on %r:\n%s", self.group.rank, msg, traceback.format_exc())
            # NOTE: its sockets close with it, so rank 0's read or write fails now, not after the group's timeout
            os._exit(1)
