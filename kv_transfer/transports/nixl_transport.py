"""The `nixl` transport, sending side: NIXL WRITE from the prefill engine's KV pool into the blocks reserved for it.

Life of a transfer, on top of `KVSender`'s (control on gRPC, as every remote transport):
1. before the handshake, the sender's process holds a `Watch` call open to the receiver (one per receiver address,
   kept for the life of the pair); `prepare` says which receiver agent's metadata it already holds, the answer
   (`NixlTarget`) carries the receiver's agent, metadata only if the sender lacks it (a new agent name: the receiver
   restarted), its pool address and the reserved block ids; the remote descriptor list is prepared once per agent;
2. `send_blocks(layer, block_ids)` from the prefill step pins the blocks (first layer) and queues the layer (on a
   GPU pool with an event on the engine's stream, which the sender's thread waits for: `layer_ready`); the
   sender's thread computes the layer's K and V checks from the pool and posts one WRITE of all its blocks (one
   descriptor per run of consecutive blocks and receiver rank) with a notification
   "<transfer_id>:<layer>:<checks K>:<checks V>" (a check per receiver rank, joined by "+"); it drives NIXL's
   progress while writes are in flight (no progress thread). A receiver rank holding other KV heads than every
   sender rank (TP groups of different sizes) gets its blocks gathered into a staging slot first
   (`nixl_reshard.py`, `nixl_writes.py`). Between two GPU pools of one node the layer is copied GPU to GPU into the
   receiver's pool mapped through CUDA IPC instead, and the same notification sent on its own (`cuda_ipc.py`,
   `_copy_direct`);
3. after the last layer it waits for every write to complete, then commits; the blocks are unpinned;
4. a transfer that fails with writes posted waits for them (or, failing that, drops the peer: the connection
   closes and the Watch ends) before telling the receiver `Abort(quiesced)`: the receiver's fence
   (`nixl_receiver.py`) keeps the reserved blocks until then;
5. a handshake that failed without an answer (its deadline passed while the receiver hung) may still be answered
   there later, and fenced: the sender names it in an `Abort(attempt_id, quiesced)` (retried in the background
   while the pair lives), which frees those blocks or refuses the late handshake. The sender never learned their
   ids, so it cannot write into them.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kv_transfer.messages import Abort, Prepared, PrepareRequest
from kv_transfer.sender import _COMMIT, KVSender, Layer
from kv_transfer.state import TransferError
from kv_transfer.transports import cuda_ipc, nixl_agent, nixl_links
from kv_transfer.transports.grpc_control import GrpcControl
from kv_transfer.transports.nixl_agent import Peer, Pool
from kv_transfer.transports.nixl_checks import PoolLayer, check_stream, layer_ready
from kv_transfer.transports.nixl_receiver import receiver_side
from kv_transfer.transports.nixl_reshard import Plan, heads_problem
from kv_transfer.transports.nixl_writes import Queued, Slot, Writes

__all__ = ["NixlKVSender", "receiver_side"]  # NOTE: whether nixl can run: nixl_load.unavailable (torch-free)

POLL_S = 0.0002  # how often the sender's thread drives NIXL while writes are in flight and no layer is queued
DRAIN_S = 2.0  # after a failure, how long posted writes get to complete before the peer is dropped


class NixlKVSender(KVSender):
    """Writes each layer's blocks from the prefill engine's pool into the receiver's reserved blocks."""

    transport = "nixl"
    control: GrpcControl
    can_read_pool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._peer: Peer | None = None
        self._pool: Pool | None = None
        self._plan: Plan | None = None  # which of this pool's ranks make each of the receiver's
        self._direct: torch.Tensor | None = None  # the receiver's GPU pool mapped here (cuda_ipc.py), if it can be
        self._remote_ids = np.zeros(0, dtype=np.int64)
        self._pinned: list[int] = []
        self._closed = False  # the sender's thread is past its data phase: nothing more is pinned
        self._posted = False  # some write was posted: an abort must say whether it completed
        self._quiet = False  # every posted write completed (the data phase ended without dropping the peer)
        self._post_lock = threading.Lock()
        self._first: object | None = None

    # ---- handshake ----------------------------------------------------------------------------------------------
    def _prepare_request(self, req: PrepareRequest) -> PrepareRequest:
        nixl_links.link(self.control)
        shards = len(self.pool.kvs) if self.pool is not None else 1
        heads = self.pool.heads if self.pool is not None else [(0, self.layout.num_kv_heads)]
        return dataclasses.replace(req, nixl_agent=nixl_agent.agent().name, nixl_shards=shards, nixl_heads=heads,
                                   nixl_known=nixl_links.known.get(self.control.address, ""))

    def _on_prepared(self, resp: Prepared) -> None:
        target = resp.nixl
        if target is None or self.pool is None:
            raise TransferError("nixl: the receiver sent no target" if target is None
                                else "nixl: the sender has no KV pool to read", self.request_id)
        agent = nixl_agent.agent()
        self._pool = pool = agent.pool(self.pool.kvs)
        self._plan = plan = self._plan_for(target.shard_heads, len(target.shard_addrs) + 1, pool)
        if nixl_links.known.get(self.control.address) not in (None, target.agent):
            # NOTE: the receiver restarted (a new agent at the same address): forget the old one; the Watch the
            # handshake just used is the new process's already
            agent.forget(nixl_links.known.pop(self.control.address))
        layers = self.layout.num_layers
        try:
            self._peer = agent.peer(target.agent, target.metadata, target.kv_addr, layers * 2, target.pool_blocks,
                                    plan.block_nbytes[0], target.mem_type, target.device_id, target.shard_addrs)
        except KeyError:
            nixl_links.known.pop(self.control.address, None)
            raise TransferError(f"nixl: no metadata for receiver agent {target.agent}", self.request_id,
                                retryable=True) from None
        nixl_links.known[self.control.address] = target.agent
        if target.cuda_ipc and len(pool.kvs) == 1 and not plan.gathers:
            self._direct = cuda_ipc.mapped(target.agent, target.cuda_ipc, pool.kv)
        self._remote_ids = np.asarray(target.block_ids, dtype=np.int64)
        if len(self._remote_ids) != resp.num_blocks:
            raise TransferError(f"nixl: {len(self._remote_ids)} block ids for {resp.num_blocks} blocks",
                                self.request_id)

    def _plan_for(self, heads: list[tuple[int, int]], ranks: int, pool: Pool) -> Plan:
        """How this pool's ranks make the receiver's `ranks` (holding `heads`); refused naming the field."""
        problem = heads_problem(heads, ranks, self.layout.num_kv_heads)
        own = self.pool.heads if self.pool is not None else [(0, self.layout.num_kv_heads)]
        if problem is None:
            try:
                plan = Plan(own, heads, pool.block_nbytes // (own[0][1] - own[0][0]))
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            raise TransferError(f"nixl: the receiver's shard_heads: {problem}", self.request_id)
        if plan.gathers and pool.mem != "DRAM":
            raise TransferError(f"nixl: shard_heads: the receiver's ranks hold KV heads {heads}, this GPU pool's "
                                f"{own}: nixl gathers heads between host pools only (use grpc)", self.request_id)
        return plan

    # ---- the caller's side --------------------------------------------------------------------------------------
    def send_layer(self, layer: int, k: Any, v: Any) -> None:
        self.abort_after(TransferError("nixl reads the engine's KV pool: open the sender with pool= and call "
                                       "send_blocks", self.request_id))

    def layer_mark(self) -> object:
        return layer_ready(self.pool.kvs[0]) if self.pool is not None else None

    def send_blocks(self, layer: int, block_ids: list[int], ready: object = None) -> None:
        if not self.state.finished and self.transfer_id:
            with self._post_lock:
                if self._closed or len(block_ids) != len(self._remote_ids):
                    return
                if not self._pinned and block_ids and self.pool is not None:
                    self.pool.pin(block_ids)
                    self._pinned = list(block_ids)
            mark = ready if ready is not None else self.layer_mark()
            self._queue_item(PoolLayer(layer, tuple(block_ids), mark))  # type: ignore[arg-type]

    def _prepare_failed(self, req: PrepareRequest, err: TransferError) -> None:
        if err.retryable:  # NOTE: not retryable: the receiver answered with a refusal, it reserved nothing
            threading.Thread(target=nixl_links.abort_attempt, daemon=True, name=f"kv-nixl-abort-{self.request_id}",
                             args=(self.control, req.attempt_id, err.reason, self.config.deadline_s)).start()

    def _abort_message(self, reason: str) -> Abort:
        with self._post_lock:  # NOTE: after _finish: a write not posted by now never will be
            return Abort(self.transfer_id, reason, quiesced=not self._posted or self._quiet)

    # ---- the sender's thread ------------------------------------------------------------------------------------
    def _first_item(self) -> object | None:
        self._first = super()._first_item()
        return self._first

    def _send_layers(self, layers: Iterator[Layer]) -> None:
        del layers  # NOTE: read from the queue directly (after `_first`), so progress goes on between layers
        assert self._plan is not None
        writes = Writes(self._plan, self._checks, self.request_id)
        try:
            if self._first is not None:
                self._write_all(writes, self._first)
        finally:
            writes.close()
            self._settle(writes)

    def _write_all(self, writes: Writes, first: object) -> None:
        # NOTE: a layer's checks are computed on this thread right before its post, unless more layers wait behind
        # it: theirs go to the checker thread meanwhile (UCX's cma copies inside the post, on this thread). In
        # alternated runs on 2 cores a backlog moved up to 15% faster so, within the noise in others (BENCHMARKS.md);
        # one layer at a time (layer-wise during a prefill) a hand-off only adds a wait for the GIL to the tail.
        # A layer whose blocks are gathered (nixl_reshard.py) is gathered with its checks (`Writes.ready`)
        committed = False
        item: object = first
        while not self.state.finished:
            while item is not None:  # everything queued so far
                if item is _COMMIT:
                    committed = True
                elif isinstance(item, PoolLayer) and item.block_ids:
                    writes.queue(item)
                item = self._next(0)
            if writes.ahead:
                self._post(writes.ready(self._deadline, lambda: not self.state.finished), writes)
                writes.progress()
                continue
            if committed:
                while writes.pending and not self.state.finished:
                    writes.progress()
                    if time.monotonic() > self._deadline:
                        raise TransferError("deadline passed while writing", self.request_id, retryable=True)
                return
            item = self._next(POLL_S if writes.pending else 0.05)
            if item is None:
                writes.progress()
                if time.monotonic() > self._deadline:
                    raise TransferError(f"deadline of {self.config.deadline_s} s passed", self.request_id,
                                        retryable=True)

    def _next(self, timeout: float) -> object | None:
        """The next queued item (None: none within `timeout`; 0: only what is queued now)."""
        try:
            return self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _checks(self, layer: PoolLayer, slot: Slot | None = None) -> tuple[str, str]:
        """The checks of one layer's K and V blocks, as its notification carries them (its gathered blocks copied
        into `slot` first)."""
        assert self._pool is not None and self._plan is not None
        if layer.ready is not None:
            layer.ready.synchronize()  # NOTE: this thread only; the engine's stream goes on (`layer_ready`)
        src = np.asarray(layer.block_ids, dtype=np.int64)
        mem = slot.tensor if slot is not None else None
        if mem is not None:
            self._plan.gather(self._pool.kvs, layer.index, src, mem)
        k, v = (self._plan.checks(self._pool.kvs, layer.index, which, src, f"{self.transfer_id}/{layer.index}/{which}",
                                  self.config.nixl_checksum, mem) for which in (0, 1))
        return k, v

    def _post(self, ready: Queued, writes: Writes) -> None:
        """Post a layer's WRITE (its slot then belongs to `writes` until the write completed)."""
        pool, peer, plan, layer = self._pool, self._peer, self._plan, ready.layer
        assert pool is not None and peer is not None and plan is not None and ready.checks is not None
        src = np.asarray(layer.block_ids, dtype=np.int64)
        checks = ready.checks.result()
        notif = f"{self.transfer_id}:{layer.index}:{checks[0]}:{checks[1]}".encode()
        agent = nixl_agent.agent()
        try:
            with self._post_lock:
                if self.state.finished:
                    return
                self._posted = True
                try:
                    if self._direct is not None:
                        try:
                            self._copy_direct(layer.index, src, notif)
                        except Exception as e:  # NOTE: this transfer fails (retryable); the next ones go by NIXL
                            cuda_ipc.refuse(peer.name, f"a copy failed: {type(e).__name__}: {e}")
                            raise
                        self.bytes_sent += plan.nbytes(len(src))
                        return
                    slot = ready.slot.addr if ready.slot is not None else 0
                    handle = agent.post(pool.mem, peer, *plan.descs(pool, peer, layer.index, src, self._remote_ids,
                                                                    slot), notif)
                    state = agent.nixl.transfer(handle)
                except Exception as e:  # noqa: BLE001 - NIXL raises its own types (a peer dropped, disconnected)
                    raise TransferError(f"nixl: write of layer {layer.index} to {peer.name}: {type(e).__name__}: "
                                        f"{e}", self.request_id, retryable=True) from None
            if state == "ERR":
                agent.nixl.release_xfer_handle(handle)
                raise TransferError(f"nixl: write of layer {layer.index} to {peer.name} failed", self.request_id,
                                    retryable=True)
            writes.posted(handle, ready)
            self.bytes_sent += plan.nbytes(len(src))
        finally:
            ready.drop()  # NOTE: a slot not posted goes back

    def _copy_direct(self, layer: int, src: np.ndarray, notif: bytes) -> None:
        """One layer's runs of blocks copied GPU to GPU into the receiver's mapped pool, then its notification.

        NOTE: the layer's kernels ran (`_checks` waited for its event); the copy runs on this thread's side stream,
        and the notification goes once it is done: the receiver checks the blocks as soon as it comes."""
        assert self._pool is not None and self._peer is not None and self._direct is not None
        ls, rs, n = nixl_agent.runs(src, self._remote_ids)
        # NOTE: on the host (no host lane offers a pool yet: tests/test_kv_cuda_ipc.py maps its own) no stream
        stream = check_stream(self._pool.kv.device)
        with torch.cuda.stream(stream):
            cuda_ipc.copy_layer(self._direct, self._pool.kv, layer, ls, rs, n)
        if stream is not None:
            stream.synchronize()
        nixl_agent.agent().nixl.send_notif(self._peer.name, notif)

    def _settle(self, writes: Writes) -> None:
        """End of the data phase: posted writes completed (or the peer dropped), blocks unpinned, receiver told."""
        with self._post_lock:
            self._closed = True
        dropped = writes.drain(time.monotonic() + DRAIN_S)
        if dropped and self._peer is not None:
            nixl_links.drop(self.control.address, self._peer.name)
        with self._post_lock:
            self._quiet = not dropped
        if self._pinned and self.pool is not None:
            self.pool.unpin(self._pinned)
            self._pinned = []
        if self.state.finished and self._posted and self.transfer_id and not dropped:
            try:
                self.control.abort(Abort(self.transfer_id, "writes done", quiesced=True), 2.0)
            except TransferError:
                pass  # NOTE: the receiver is gone, or our Watch ends when this process does
