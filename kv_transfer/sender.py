"""Prefill side of a transfer: one `KVSender` per request, driven by the prefill loop, polled by the caller.

Life of an outbound transfer:
1. `prepare()`: the handshake; the receiver reserves blocks and says how many leading ones it already caches
   (`cached_blocks`): only the rest are sent; until the first layer is ready (the prompt may wait in the prefill
   queue far longer than the deadline), the sender's thread calls `keep_alive` every deadline/3, and the deadline
   runs from the first layer on; a sender that dies stops calling, and the receiver expires the reservation;
2. `send_layer(layer, k, v)` as each layer's KV is ready (from `LLMEngine.watch_layers` during the prefill step);
   a background thread moves the data while the prefill goes on; a sender that `reads_pool` (nixl, opened with
   the engine's `KVPool`) takes `send_blocks(layer, block_ids)` instead and reads the blocks from the pool itself;
3. `commit(next_token_ids)`: after the last layer, hands over the sampled token(s); the receiver then completes;
4. `poll()` → WAITING | TRANSFERRING | DONE | FAILED (`error` says why). `on_finish` runs once it is DONE or
   FAILED: the prefill worker unpins its blocks there. Any failure aborts the receiver's side too.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.kv_export import KVLayout
from kv_transfer.control import Control, Layer
from kv_transfer.messages import Abort, Commit, Prepared, PrepareRequest
from kv_transfer.pool import KVPool
from kv_transfer.state import TransferConfig, TransferError, TransferState, Transport

log = logging.getLogger(__name__)
__all__ = ["Control", "KVSender", "Layer"]  # NOTE: Control and Layer live in kv_transfer/control.py


_COMMIT = object()


class KVSender(ABC):
    """Sends one request's KV to one receiver; subclasses move the data (`_send_layers`)."""

    transport: Transport
    can_read_pool = False  # the transport can read blocks from the engine's KV pool itself (`send_blocks`)
    pool: KVPool | None = None  # that pool, set by `open_sender`
    lora: str = ""  # the LoRA adapter the KV was computed with ("": the base model), set by `open_sender`

    def __init__(self, control: Control, config: TransferConfig, request_id: str, layout: KVLayout,
                 token_ids: Sequence[int], num_prompt_tokens: int, block_hashes: Sequence[bytes], *,
                 sender_id: str = "", on_finish: Callable[[KVSender], None] | None = None) -> None:
        self.control, self.config, self.request_id, self.layout = control, config, request_id, layout
        self.token_ids, self.num_prompt_tokens, self.block_hashes = list(token_ids), num_prompt_tokens, block_hashes
        self.sender_id = sender_id
        self.on_finish = on_finish
        self.state = TransferState.WAITING
        self.error: TransferError | None = None
        self.cached_blocks = 0
        self.num_blocks = 0  # blocks sent per layer
        self.transfer_id = ""
        self.bytes_sent = 0
        self.started = self.finished_at = 0.0
        self._deadline = 0.0
        self._sending = False  # the first layer was queued: the deadline runs from then on, no more keep-alives
        self._committing = False  # the commit was asked: the receiver may be DONE
        self._queue: queue.Queue[object] = queue.Queue()
        self._next_token_ids: list[int] = []
        self._num_cached_tokens = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the caller's side ----------------------------------------------------------------------------------
    def prepare(self) -> int:
        """Handshake; returns how many leading blocks the receiver caches (they are not sent)."""
        self.started = time.monotonic()
        self._deadline = self.started + self.config.deadline_s
        req = PrepareRequest(self.request_id, self.layout, self.token_ids, self.num_prompt_tokens,
                             [bytes(h) for h in self.block_hashes], self.transport,
                             int(self.config.deadline_s * 1000), self.sender_id, attempt_id=uuid.uuid4().hex,
                             lora=self.lora)
        try:
            resp = self.control.prepare(self._prepare_request(req), self.remaining())
        except TransferError as e:
            self._finish(e)
            self._prepare_failed(req, e)
            raise
        self.transfer_id, self.cached_blocks, self.num_blocks = resp.transfer_id, resp.cached_blocks, resp.num_blocks
        with _finish_lock:
            aborted = self.state.finished  # NOTE: aborted while the handshake was in flight (the prefill ran beside it)
            if not aborted:
                self.state = TransferState.TRANSFERRING
        if aborted:
            try:
                self.control.abort(self._abort_message("aborted during the handshake"), 2.0)
            except TransferError:
                pass  # the receiver is gone: its own deadline frees its side
            raise self.error or TransferError("aborted during the handshake", self.request_id)
        try:
            self._on_prepared(resp)
        except TransferError as e:
            self.abort_after(e)
            raise
        # NOTE: the thread runs in a copy of the caller's context, so its logs carry the caller's request id
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), daemon=True,
                                        name=f"kv-send-{self.request_id}")
        self._thread.start()
        return self.cached_blocks

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's K and V of blocks [cached_blocks, ...) (each [num_blocks, block_size, KVH, D])."""
        self._queue_item(Layer(layer, k, v))

    def _queue_item(self, item: object) -> None:
        """Hand a layer to the sender's thread (the deadline runs from the first one on)."""
        if self.state is TransferState.TRANSFERRING:
            if not self._sending:
                self._sending = True
                self._deadline = time.monotonic() + self.config.deadline_s
            self._queue.put(item)

    @property
    def reads_pool(self) -> bool:
        """Whether the caller hands this sender block ids of its `pool` (`send_blocks`) rather than copies."""
        return self.can_read_pool and self.pool is not None

    def send_blocks(self, layer: int, block_ids: list[int], ready: object = None) -> None:
        """Queue one layer of the pool's blocks `block_ids` (those after `cached_blocks`); only if `reads_pool`.
        `ready`: the layer's `layer_mark()` when it was taken earlier (a layer held for the handshake)."""
        raise NotImplementedError(f"the {self.transport} transport sends copies: use send_layer")

    def layer_mark(self) -> object:
        """(in a layer's hook) what tells the sender later that the layer's K/V are written: a GPU event on the
        engine's stream, None on the host."""
        return None

    def commit(self, next_token_ids: Sequence[int], num_cached_tokens: int = 0) -> None:
        """After the last layer: the token(s) sampled after the KV; the receiver completes on it."""
        self._next_token_ids, self._num_cached_tokens = list(next_token_ids), num_cached_tokens
        self._queue.put(_COMMIT)

    def abort(self, reason: str) -> None:
        """Stop now and tell the receiver to free its reservation."""
        if self._finish(TransferError(f"aborted: {reason}", self.request_id)) and self.transfer_id:
            try:
                self.control.abort(self._abort_message(reason), 2.0)
            except TransferError:
                pass  # the receiver is gone: its own deadline frees its side

    def poll(self) -> TransferState:
        if not self.state.finished and self._deadline and time.monotonic() > self._deadline:
            self.abort(f"deadline of {self.config.deadline_s} s passed")
        return self.state

    def wait(self, timeout: float | None = None) -> TransferState:
        self._done.wait(timeout)
        return self.poll()

    def remaining(self) -> float:
        return max(0.001, self._deadline - time.monotonic())

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started

    # ---- the transport's side -------------------------------------------------------------------------------
    def _prepare_request(self, req: PrepareRequest) -> PrepareRequest:
        """Hook for transports that add to the handshake (nixl: its agent)."""
        return req

    def _prepare_failed(self, req: PrepareRequest, err: TransferError) -> None:
        """Hook for transports whose receiver keeps a reservation the sender never learned of (nixl's fence)."""
        return None

    def _abort_message(self, reason: str) -> Abort:
        """What the receiver is told when this side stops the transfer (nixl: whether writes are in flight)."""
        return Abort(self.transfer_id, reason)

    def _on_prepared(self, resp: Prepared) -> None:
        """Hook for transports that set something up after the handshake (torch: the pair group)."""
        return None

    def _watch(self) -> AbstractContextManager[object]:
        """Hook for transports whose data plane may hang on a dead receiver: a watch of it while the data moves
        and the commit is asked (torch: `liveness.PeerWatch`)."""
        return nullcontext()

    @abstractmethod
    def _send_layers(self, layers: Iterator[Layer]) -> None:
        """Move every layer the iterator yields to the receiver; raise TransferError on failure.

        Called once the first layer is ready, or once the transfer finished without one (the iterator is empty).
        """

    def _first_item(self) -> object | None:
        """Wait for the first layer (or the commit), keeping the receiver's reservation alive meanwhile.

        NOTE: the handshake comes before the prompt queues for prefill; under load the queue outlasts any sane
        deadline, and a transfer that expired there would be prefilled again elsewhere, the work done twice exactly
        when the cluster is saturated. So until the first layer the deadline is renewed by keep-alives (None: the
        transfer finished meanwhile).
        """
        interval = self.config.deadline_s / 3
        beat = time.monotonic() + interval
        while not self.state.finished:
            try:
                return self._queue.get(timeout=max(0.001, min(0.5, beat - time.monotonic())))
            except queue.Empty:
                pass
            if time.monotonic() >= beat and not self._sending and not self.state.finished:
                try:
                    self._keep_alive()
                except TransferError as e:
                    self.abort_after(e)
                beat = time.monotonic() + interval
        return None

    def _keep_alive(self) -> None:
        sent = time.monotonic()
        try:
            self.control.keep_alive(self.transfer_id, min(self.remaining(), self.config.deadline_s / 3))
        except TransferError as e:
            # NOTE: a receiver that is briefly unreachable gets more tries until the last renewal runs out
            if not e.retryable or time.monotonic() > self._deadline:
                raise
            return
        if not self._sending:
            self._deadline = max(self._deadline, sent + self.config.deadline_s)

    def _layers(self, first: object) -> Iterator[Layer]:
        """Layers as the caller queues them (from `first` on), until commit (or the deadline/abort)."""
        if first is None or first is _COMMIT:
            return
        assert isinstance(first, Layer)
        yield first
        while True:
            try:
                item = self._queue.get(timeout=min(0.5, self.remaining()))
            except queue.Empty:
                if self.state.finished:
                    return
                if time.monotonic() > self._deadline:
                    raise TransferError(f"deadline of {self.config.deadline_s} s passed", self.request_id,
                                        retryable=True) from None
                continue
            if item is _COMMIT or self.state.finished:
                return
            assert isinstance(item, Layer)
            yield item

    def _run(self) -> None:
        try:
            first = self._first_item()
            with self._watch():
                # NOTE: also when the transfer ended before its first layer: a transport may owe its peer a word
                self._send_layers(self._layers(first))
                if self.state.finished:
                    return
                self._committing = True
                received = self.control.commit(Commit(self.transfer_id, self._next_token_ids,
                                                      self._num_cached_tokens), self.remaining())
            log.debug("KV of %s sent: %d bytes in %.3f s", self.request_id, received, self.seconds)
            self._finish(None)
        except TransferError as e:
            self.abort_after(e)
        except Exception as e:  # noqa: BLE001 - any failure of the transport fails the transfer, never the worker
            self.abort_after(TransferError(f"{type(e).__name__}: {e}", self.request_id))

    def abort_after(self, err: TransferError) -> None:
        if self._finish(err) and self.transfer_id:
            try:
                self.control.abort(self._abort_message(err.reason), 1.0)
            except TransferError:
                pass

    def _finish(self, err: TransferError | None) -> bool:
        """Enter DONE or FAILED once; returns False if already finished."""
        with _finish_lock:
            if self.state.finished:
                return False
            self.state, self.error = (TransferState.FAILED, err) if err else (TransferState.DONE, None)
            self.finished_at = time.monotonic()
        if err is not None:
            log.warning("KV transfer of %s failed: %s", self.request_id, err.reason)
        self._done.set()
        if self.on_finish is not None:
            self.on_finish(self)
        return True


_finish_lock = threading.Lock()
