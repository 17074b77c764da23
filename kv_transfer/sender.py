"""Prefill side of a transfer: one `KVSender` per request, driven by the prefill loop, polled by the caller.

Life of an outbound transfer:
1. `prepare()`: the handshake; the receiver reserves blocks and says how many leading ones it already caches
   (`cached_blocks`): only the rest are sent;
2. `send_layer(layer, k, v)` as each layer's KV is ready (from `LLMEngine.watch_layers` during the prefill step);
   a background thread moves the data while the prefill goes on;
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.kv_export import KVLayout
from kv_transfer.messages import Abort, Commit, Prepared, PrepareRequest
from kv_transfer.state import TransferConfig, TransferError, TransferState, Transport

log = logging.getLogger(__name__)


class Control(ABC):
    """The control plane to one receiver: the handshake, commit and abort (gRPC, or a direct call in-process)."""

    @abstractmethod
    def prepare(self, req: PrepareRequest, timeout: float) -> Prepared: ...

    @abstractmethod
    def commit(self, req: Commit, timeout: float) -> int:
        """Returns the bytes the receiver got."""

    @abstractmethod
    def abort(self, req: Abort, timeout: float) -> None: ...


@dataclass
class Layer:
    """One layer's K and V of the blocks to send, each [num_blocks, block_size, KVH, D]."""

    index: int
    k: torch.Tensor
    v: torch.Tensor


_COMMIT = object()


class KVSender(ABC):
    """Sends one request's KV to one receiver; subclasses move the data (`_send_layers`)."""

    transport: Transport

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
                             int(self.config.deadline_s * 1000), self.sender_id)
        try:
            resp = self.control.prepare(req, self.remaining())
        except TransferError as e:
            self._finish(e)
            raise
        self.transfer_id, self.cached_blocks, self.num_blocks = resp.transfer_id, resp.cached_blocks, resp.num_blocks
        self.state = TransferState.TRANSFERRING
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
        if self.state is TransferState.TRANSFERRING:
            self._queue.put(Layer(layer, k, v))

    def commit(self, next_token_ids: Sequence[int], num_cached_tokens: int = 0) -> None:
        """After the last layer: the token(s) sampled after the KV; the receiver completes on it."""
        self._next_token_ids, self._num_cached_tokens = list(next_token_ids), num_cached_tokens
        self._queue.put(_COMMIT)

    def abort(self, reason: str) -> None:
        """Stop now and tell the receiver to free its reservation."""
        if self._finish(TransferError(f"aborted: {reason}", self.request_id)) and self.transfer_id:
            try:
                self.control.abort(Abort(self.transfer_id, reason), 2.0)
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
    def _on_prepared(self, resp: Prepared) -> None:
        """Hook for transports that set something up after the handshake (torch: the pair group)."""
        return None

    @abstractmethod
    def _send_layers(self, layers: Iterator[Layer]) -> None:
        """Move every layer the iterator yields to the receiver; raise TransferError on failure."""

    def _layers(self) -> Iterator[Layer]:
        """Layers as the caller queues them, until commit (or the deadline/abort)."""
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
            self._send_layers(self._layers())
            if self.state.finished:
                return
            received = self.control.commit(Commit(self.transfer_id, self._next_token_ids, self._num_cached_tokens),
                                           self.remaining())
            log.debug("KV of %s sent: %d bytes in %.3f s", self.request_id, received, self.seconds)
            self._finish(None)
        except TransferError as e:
            self.abort_after(e)
        except Exception as e:  # noqa: BLE001 - any failure of the transport fails the transfer, never the worker
            self.abort_after(TransferError(f"{type(e).__name__}: {e}", self.request_id))

    def abort_after(self, err: TransferError) -> None:
        if self._finish(err) and self.transfer_id:
            try:
                self.control.abort(Abort(self.transfer_id, err.reason), 1.0)
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
