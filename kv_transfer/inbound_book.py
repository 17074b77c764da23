"""The book of one engine's inbound KV transfers: find them, fail and free them, fence them, expire them.

kv_transfer/receiver.py (`KVReceiver`) takes a transfer through its steps (handshake, data, commit, take); this is
what it and the transports share about every transfer whatever its step: the transfers by id and by request, the
lock and the condition data lands on, failing one (once: its blocks freed when no write into them is in flight and
no sender writes into them itself: `fence`), aborts from the sender (also of a handshake not yet come), the
keep-alives, and the thread that expires transfers whose deadline passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from engine.llm_engine import LLMEngine
from kv_transfer.inbound import Inbound
from kv_transfer.messages import Abort
from kv_transfer.state import TransferError, TransferState

log = logging.getLogger("kv_transfer.receiver")  # NOTE: the name its log lines always had
MAX_ABANDONED = 4096  # handshakes remembered as aborted before they came (each for max_deadline_s)


class InboundBook:
    """One engine's inbound transfers, as every step and transport sees them (plain class, thread-safe)."""

    def __init__(self, engine: LLMEngine, engine_lock: AbstractContextManager[Any] | None, max_deadline_s: float,
                 reap_interval_s: float) -> None:
        self.engine = engine
        self.engine_lock = engine_lock or threading.RLock()  # NOTE: the decode loop steps under this same lock
        self.max_deadline_s = max_deadline_s
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # notified as data lands and receive threads end
        self._by_id: dict[str, Inbound] = {}
        self._by_request: dict[str, Inbound] = {}
        self._abandoned: dict[str, float] = {}  # attempt id → when to forget it: handshakes aborted before they came
        self.on_fail: Callable[[Inbound], None] | None = None  # transport hooks (torch): torn down on failure
        # NOTE: the decode worker starts decoding the moment a transfer settles (DONE or FAILED), not when the
        # router next calls: called after the state changed, outside the book's lock, on the settling thread
        self.on_settled: Callable[[str, TransferState], None] | None = None
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,), daemon=True,
                                        name="kv-receiver-reaper")
        self._reaper.start()

    def poll(self, request_id: str) -> TransferState:
        t = self._by_request.get(request_id)
        return t.state if t else TransferState.FAILED

    def error(self, request_id: str) -> TransferError | None:
        t = self._by_request.get(request_id)
        return t.error if t else TransferError("unknown transfer", request_id)

    def wait(self, request_id: str, timeout: float | None = None) -> TransferState:
        """Block until the transfer is DONE or FAILED (or the timeout passes); returns the state."""
        t = self._by_request.get(request_id)
        if t is None:
            return TransferState.FAILED
        t.done.wait(timeout)
        return t.state

    def abort(self, req: Abort) -> None:
        """The sender stopped the transfer (named by its id, or by the handshake's `attempt_id`)."""
        if not req.transfer_id and req.attempt_id:
            self._abort_attempt(req)
            return
        t = self._by_id.get(req.transfer_id)
        if t is not None:
            self._fail(t, f"aborted by sender: {req.reason}")
            if req.quiesced:
                self.unfence(t)

    def _abort_attempt(self, req: Abort) -> None:
        """The sender gave up a handshake before its answer came: it never learned the block ids, so nothing of
        it is written into them; free its reservation now, or refuse the handshake if it has not come yet."""
        with self._lock:
            t = next((t for t in self._by_id.values() if t.attempt_id == req.attempt_id), None)
            if t is None:
                if len(self._abandoned) >= MAX_ABANDONED:  # NOTE: the oldest goes (the gRPC handler's check remains)
                    del self._abandoned[next(iter(self._abandoned))]
                self._abandoned[req.attempt_id] = time.monotonic() + self.max_deadline_s
                return
        self.abandon(t.transfer_id, f"aborted by sender before the handshake's answer: {req.reason}")

    def abandon(self, transfer_id: str, reason: str) -> None:
        """The sender never got the handshake's answer (its call ended first): it cannot write into the blocks,
        so they are freed at once, fenced or not."""
        t = self._by_id.get(transfer_id)
        if t is not None:
            self._fail(t, reason, retryable=True)
            self.unfence(t)

    def find(self, transfer_id: str) -> Inbound | None:
        return self._by_id.get(transfer_id)

    def fence(self, t: Inbound) -> None:
        """The sender writes into `t`'s blocks itself: a failure keeps them until `unfence` (see the module doc)."""
        with self._lock:
            t.fenced = t.state is not TransferState.FAILED  # NOTE: one abandoned meanwhile is freed already

    def unfence(self, t: Inbound) -> None:
        """No write of the sender into `t`'s blocks is in flight any more (it said so, every layer landed, or it is
        gone): a failed transfer's blocks are freed now."""
        with self._lock:
            if not t.fenced:
                return
            t.fenced = False
            free_now = t.state is TransferState.FAILED and t.writers == 0
        if free_now:
            self._free(t)

    def abort_request(self, request_id: str, reason: str = "aborted") -> None:
        t = self._by_request.get(request_id)
        if t is not None:
            self._fail(t, reason)

    def fail(self, transfer_id: str, reason: str, *, retryable: bool = False) -> None:
        """A transport saw the transfer break (stream cut, peer gone): free its reservation now."""
        t = self._by_id.get(transfer_id)
        if t is not None:
            self._fail(t, reason, retryable=retryable)

    def keep_alive(self, transfer_id: str) -> None:
        """The sender still wants `transfer_id` (its prompt waits for prefill): its deadline runs again from now."""
        with self._lock:
            t = self._by_id.get(transfer_id)
            if t is None or t.state is not TransferState.TRANSFERRING:
                why = f"{t.state.value}" + (f": {t.error.reason}" if t.error else "") if t else "unknown"
                raise TransferError(f"cannot keep transfer {transfer_id} alive ({why})", t.request_id if t else None)
            if not t.data_started:
                t.deadline = max(t.deadline, time.monotonic() + t.lifetime)

    def set_receiving(self, t: Inbound, receiving: bool) -> None:
        """A transport thread starts or stops pulling `t`'s data (commit waits while one is)."""
        with self._lock:
            t.receiving = receiving
            self._progress.notify_all()

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return sum(not t.state.finished for t in self._by_id.values())

    def close(self) -> None:
        self._closed.set()
        for t in list(self._by_id.values()):
            self._fail(t, "receiver closed")
        # NOTE: a daemon thread that drops the last engine reference during interpreter exit aborts the process.
        if threading.current_thread() is not self._reaper:
            self._reaper.join(timeout=1.0)

    def _get(self, transfer_id: str) -> Inbound:
        t = self._by_id.get(transfer_id)
        if t is None:
            raise TransferError(f"unknown transfer {transfer_id!r}")
        return t

    def _fail(self, t: Inbound, reason: str, *, retryable: bool = False) -> None:
        with self._lock:
            if t.state is TransferState.FAILED or t.transfer_id not in self._by_id:
                return  # NOTE: a taken transfer left _by_id: it belongs to the engine now
            log.warning("KV transfer %s of request %s failed: %s", t.transfer_id, t.request_id, reason,
                        extra={"request_id": t.request_id})
            t.state, t.error = TransferState.FAILED, TransferError(reason, t.request_id, retryable=retryable)
            t.done.set()
            self._progress.notify_all()
            free_now = t.writers == 0 and not t.fenced
        if free_now:
            self._free(t)
        if self.on_fail is not None:
            self.on_fail(t)
        if self.on_settled is not None:
            self.on_settled(t.request_id, TransferState.FAILED)

    def _free(self, t: Inbound) -> None:
        with self._lock:
            if t.freed:
                return
            t.freed = True
        with self.engine_lock:
            self.engine.abort_request(t.request_id)  # frees the reservation (linked blocks stay cached)
        with self._lock:
            self._forget(t)

    def _forget(self, t: Inbound) -> None:
        # NOTE: a failed transfer stays visible (`poll`, `error`, late chunks get its reason) for a minute.
        if t.state is TransferState.FAILED:
            return
        self._by_id.pop(t.transfer_id, None)
        if self._by_request.get(t.request_id) is t:
            del self._by_request[t.request_id]

    def _reap_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            now = time.monotonic()
            for t in [t for t in list(self._by_id.values()) if t.deadline < now]:
                what = "not taken" if t.state is TransferState.DONE else "not committed"
                self._fail(t, f"deadline passed: {what} in time", retryable=True)
            with self._lock:  # failed transfers stay pollable for a minute
                for attempt in [a for a, until in self._abandoned.items() if until < now]:
                    del self._abandoned[attempt]
                for t in [t for t in self._by_id.values()
                          if t.state is TransferState.FAILED and not t.fenced and t.deadline + 60 < now]:
                    del self._by_id[t.transfer_id]
                    if self._by_request.get(t.request_id) is t:
                        del self._by_request[t.request_id]
