"""Decode side of a transfer: reserve on handshake, check and write what arrives, complete on commit, expire.

Life of an inbound transfer:
1. `prepare` checks the sender's description against the engine and reserves blocks (cached ones linked); while
   the sender waits for its prompt's first layer, its `keep_alive` calls renew the deadline;
2. data arrives as chunks: bytes (`on_chunk`, grpc) or tensors (`on_tensor`, torch/local); each chunk's CRC32C
   (of its place and bytes) is checked before it is written into the reserved blocks, on the thread it came on;
3. `commit` completes it once every block of every layer arrived (DONE); the decode worker then `take`s it into
   its running batch with the request's sampling params;
4. a failure, an abort from either side, a broken stream, or a missed deadline frees the reservation (FAILED),
   once no write into it is in flight: the receiver's own writes end first, and a transport that writes into the
   pool from the other side (nixl) `fence`s the transfer until the sender is known to write no more (`unfence`).
   A handshake whose sender gave up before the answer reached it (its call ended: `abandon`; or it sent an `Abort`
   naming the handshake's `attempt_id`) is freed at once, fenced or not: the sender never learned the block ids,
   so it cannot write into them; an `Abort` that arrives before its handshake refuses it.
A background thread expires transfers whose deadline passed, including DONE ones nobody took. The deadline runs
from the handshake, again from each keep-alive, and from the first data on (then no keep-alive moves it).

Steps 1-3 and `take` are here; what every step and transport shares (the transfers by id and request, failing and
freeing one, fences, aborts, keep-alives, expiry) is kv_transfer/inbound_book.py, this class's base.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from engine.errors import EngineError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer import payload
from kv_transfer.inbound import Inbound
from kv_transfer.inbound_book import InboundBook
from kv_transfer.messages import Chunk, Commit, NixlTarget, Prepared, PrepareRequest, TorchRendezvous
from kv_transfer.state import TRANSPORTS, TransferError, TransferState


class KVReceiver(InboundBook):
    """Holds the inbound transfers of one engine; transports hand it what arrives (plain class, thread-safe)."""

    def __init__(self, engine: LLMEngine, engine_lock: AbstractContextManager[Any] | None = None, *,
                 max_deadline_s: float = 120.0, reap_interval_s: float = 0.05) -> None:
        super().__init__(engine, engine_lock, max_deadline_s, reap_interval_s)
        self.layout = engine.kv_layout
        # transport hooks (torch, nixl): set up on handshake (torn down on failure: InboundBook.on_fail)
        self.on_prepare: Callable[[PrepareRequest, Inbound], TorchRendezvous | NixlTarget | None] | None = None
        self.transport = ""  # the transport whose hooks are set ("torch", "nixl")
        self.on_watch: Callable[[str, str], Callable[[], None]] | None = None  # nixl: (agent, gRPC peer) → its end
        self.on_commit: Callable[[], None] | None = None  # nixl: the commit came, the last layers are due

    # ---- 1. handshake ---------------------------------------------------------------------------------------
    def prepare(self, req: PrepareRequest) -> Prepared:
        """Check the description, reserve blocks; raises InvalidRequestError/CapacityError before any write."""
        rid = req.request_id
        if not rid:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if req.transport not in TRANSPORTS:
            raise InvalidRequestError("transport", f"must be one of {', '.join(TRANSPORTS)}, got {req.transport!r}",
                                      rid)
        if not 0 < req.deadline_ms <= self.max_deadline_s * 1000:
            raise InvalidRequestError("deadline_ms", f"must be in (0, {int(self.max_deadline_s * 1000)}]", rid)
        with self.engine_lock:
            res = self.engine.reserve_kv(rid, req.layout, req.token_ids, req.num_prompt_tokens, req.block_hashes,
                                         lora=req.lora or None)
        n = len(res.fresh_blocks)
        t = Inbound(uuid.uuid4().hex, res, time.monotonic() + req.deadline_ms / 1000,
                    np.zeros((self.layout.num_layers, 2, n), dtype=bool), req.deadline_ms / 1000,
                    attempt_id=req.attempt_id)
        with self._lock:
            self._by_id[t.transfer_id] = t
            self._by_request[rid] = t
            abandoned = self._abandoned.pop(req.attempt_id, None) is not None  # NOTE: "" is never remembered
        if abandoned:  # NOTE: the sender's abort of this handshake overtook it (e.g. while this engine hung)
            self._fail(t, "the sender gave this handshake up before it was answered", retryable=True)
            raise TransferError("handshake aborted by the sender", rid, retryable=True)
        extra = None
        if req.transport in ("torch", "nixl"):
            if self.on_prepare is None or self.transport != req.transport:
                self._fail(t, f"this receiver has no {req.transport} transport", retryable=False)
                raise InvalidRequestError("transport", f"{req.transport} is not enabled on this receiver", rid)
            try:
                extra = self.on_prepare(req, t)
            except EngineError as e:
                self._fail(t, e.reason, retryable=isinstance(e, TransferError) and e.retryable)
                raise
            if t.state is TransferState.FAILED:  # NOTE: aborted (by its attempt id) while the transport set up
                self.unfence(t)
                raise t.error or TransferError("aborted during the handshake", rid, retryable=True)
        if isinstance(extra, NixlTarget):
            return Prepared(t.transfer_id, res.start_block, n, nixl=extra)
        return Prepared(t.transfer_id, res.start_block, n, extra)

    # ---- 2. data --------------------------------------------------------------------------------------------
    def on_chunk(self, chunk: Chunk, data: payload.Buffer) -> None:
        """Some blocks of K or V of one layer as bytes (grpc: a view of the message), checked, then written."""
        expected = chunk.num_blocks * payload.block_nbytes(self.layout)
        if len(data) != expected:
            t = self._get(chunk.transfer_id)
            self._fail(t, f"chunk of {len(data)} bytes for {chunk.num_blocks} blocks (expected {expected})")
            raise InvalidRequestError("data", f"{len(data)} bytes for {chunk.num_blocks} blocks", t.request_id)
        self._check(chunk, data)
        self._write(chunk.transfer_id, chunk.layer, chunk.kv, chunk.first_block,
                    payload.tensor_from_bytes(data, self.layout, chunk.num_blocks))

    def on_tensor(self, chunk: Chunk, kv: torch.Tensor) -> None:
        """Blocks of K or V of one layer ([n, *block_shape]) described by `chunk` (torch, local), checked, written."""
        self._check(chunk, kv)
        self._write(chunk.transfer_id, chunk.layer, chunk.kv, chunk.first_block, kv)

    def _check(self, chunk: Chunk, data: torch.Tensor | payload.Buffer) -> None:
        if not payload.intact(chunk, data):
            t = self._get(chunk.transfer_id)
            reason = f"checksum mismatch in {chunk.where()}"
            self._fail(t, reason, retryable=True)
            raise TransferError(reason, t.request_id, retryable=True)

    def _write(self, transfer_id: str, layer: int, which: int, first: int, kv: torch.Tensor) -> None:
        t = self._begin_write(transfer_id)
        try:
            self.engine.write_kv_blocks(t.res, layer, which, first, kv)
        except EngineError as e:
            self._end_write(t)
            # NOTE: the engine drops writes into a reservation it freed (an abort there, issue 14 item 3)
            self._fail(t, "aborted on the receiving engine" if t.res.closed else f"bad data: {e.reason}")
            raise
        self._end_write(t, layer, which, first, kv.shape[0], kv.numel() * kv.element_size())

    def landed(self, t: Inbound, layer: int, nbytes: int) -> bool:
        """Every block of `layer` was written into the pool by the sender itself (nixl) and checked; returns
        whether every layer has landed now."""
        with self._lock:
            self._started(t)
            t.received[layer] = True
            t.bytes_received += nbytes
            done = bool(t.received.all())
            if done:
                t.receiving = False
            self._progress.notify_all()
            return done

    def _begin_write(self, transfer_id: str) -> Inbound:
        with self._lock:
            t = self._by_id.get(transfer_id)
            if t is None or t.state is not TransferState.TRANSFERRING:
                if t is not None and t.error is not None:
                    raise t.error
                raise TransferError(f"transfer {transfer_id}: unknown or finished", t.request_id if t else None)
            t.writers += 1
            self._started(t)
            return t

    def _started(self, t: Inbound) -> None:
        """Data of `t` arrived (or a transport began pulling it): its deadline runs from now, once."""
        if not t.data_started:
            t.data_started = True
            t.deadline = time.monotonic() + t.lifetime

    def _end_write(self, t: Inbound, layer: int = 0, which: int = 0, first: int = 0, n: int = 0,
                   nbytes: int = 0) -> None:
        with self._lock:
            t.writers -= 1
            t.received[layer, which, first : first + n] = True
            t.bytes_received += nbytes
            free_now = t.state is TransferState.FAILED and t.writers == 0 and not t.fenced
            self._progress.notify_all()
        if free_now:
            self._free(t)

    # ---- 3. completion --------------------------------------------------------------------------------------
    def commit(self, req: Commit) -> int:
        """The sender is done: DONE if every block arrived (returns the bytes received), else fail naming the gap."""
        t = self._get(req.transfer_id)
        if self.on_commit is not None:
            self.on_commit()
        with self._lock:
            # NOTE: torch sends complete when the bytes left the sender; the receive thread may still be writing.
            self._progress.wait_for(lambda: not (t.receiving or t.writers) or t.state is not TransferState.TRANSFERRING,
                                    timeout=max(0.0, t.deadline - time.monotonic()))
            if t.state is not TransferState.TRANSFERRING:
                # NOTE: as retryable as what failed it (nixl learns of a checksum mismatch only here)
                raise TransferError(f"cannot commit a {t.state.value} transfer"
                                    + (f": {t.error.reason}" if t.error else ""), t.request_id,
                                    retryable=t.error is not None and t.error.retryable)
            missing = np.argwhere(~t.received)
            if len(missing) == 0 and t.writers == 0:
                t.next_token_ids = list(req.next_token_ids)
                t.num_cached_tokens = req.num_cached_tokens
                t.fenced = False  # NOTE: a sender commits once its own writes completed
                t.state = TransferState.DONE
                t.done.set()
                received = t.bytes_received
            else:
                received = -1
        if received >= 0:
            if self.on_settled is not None:
                self.on_settled(t.request_id, TransferState.DONE)
            return received
        where = f"layer {missing[0][0]} {'KV'[missing[0][1]]} block {missing[0][2]}" if len(missing) else "writes"
        reason = f"committed before all data arrived ({len(missing)} block(s) missing, first: {where})"
        self._fail(t, reason, retryable=True)
        raise TransferError(reason, t.request_id, retryable=True)

    def take(self, request_id: str, params: SamplingParams, sent_chars: int = 0) -> Sequence:
        """Hand a DONE transfer to the engine's running batch with the request's sampling params.

        `sent_chars`: how much of the first token's text the client already has (the prefill worker may hold some
        back for a stop string); the engine emits the rest.
        """
        with self._lock:
            t = self._by_request.get(request_id)
            if t is None or t.state is not TransferState.DONE:
                state = t.state.value if t else "unknown"
                raise TransferError(f"no completed transfer to take (state: {state})", request_id)
            self._forget(t)
        with self.engine_lock:
            return self.engine.commit_kv(request_id, t.next_token_ids, params, t.num_cached_tokens, sent_chars)

    def next_token_ids(self, request_id: str) -> list[int]:
        """The tokens a DONE transfer's sender sampled after the KV it sent (empty if there is none)."""
        t = self._by_request.get(request_id)
        return list(t.next_token_ids) if t is not None and t.state is TransferState.DONE else []
