"""`PeerWatch`: the receiver's control plane, pinged while a data plane waits on it.

NOTE: gloo may wait on a dead peer until its own timeout (a TCPStore or gloo connect to a receiver killed while the
pair group formed retries until then; a socket whose peer vanished without a reset never errors), so a transport
that waits on it cannot tell a slow receiver from a dead one. Robust systems watch the peer out of band: while the
watch runs, a thread calls the receiver's `KeepAlive` every `interval` seconds; the receiver is lost when it answers
that it no longer holds the transfer (one answer), or when `misses` calls in a row fail to reach it (a killed
process refuses at once: ~`misses * interval` seconds; a vanished node times out each call).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from kv_transfer.state import TransferError

log = logging.getLogger(__name__)


class PeerWatch:
    """While entered, calls `on_lost(error, unreachable)` once if the receiver of `transfer_id` is lost; its answer
    that it no longer holds the transfer counts only while `answers()` (not once the commit went out)."""

    def __init__(self, keep_alive: Callable[[str, float], None], transfer_id: str,
                 on_lost: Callable[[TransferError, bool], None], *, answers: Callable[[], bool] = lambda: True,
                 interval: float = 0.5, timeout: float = 2.0, misses: int = 3) -> None:
        self.keep_alive, self.transfer_id, self.on_lost, self.answers = keep_alive, transfer_id, on_lost, answers
        self.interval, self.timeout, self.misses = interval, timeout, misses
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-peer-watch-{transfer_id}")

    def __enter__(self) -> PeerWatch:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()

    def _run(self) -> None:
        missed = 0
        while not self._stop.wait(self.interval):
            try:
                self.keep_alive(self.transfer_id, self.timeout)
                missed = 0
                continue
            except TransferError as e:
                if self._stop.is_set():
                    return  # NOTE: the transfer ended meanwhile (its commit may have completed the receiver's side)
                if not e.retryable and not self.answers():
                    missed = 0  # NOTE: an answer that may be stale (the commit went out): the receiver is up
                    continue
                if not e.retryable:  # the receiver answered: it failed or dropped the transfer
                    self.on_lost(TransferError(f"the receiver dropped the transfer: {e.reason}", e.request_id), False)
                    return
                missed += 1
                log.debug("receiver of %s missed a liveness call (%d): %s", self.transfer_id, missed, e.reason)
                if missed >= self.misses:
                    self.on_lost(TransferError(f"the receiver is unreachable ({missed} calls in a row failed, last: "
                                               f"{e.reason})", e.request_id, retryable=True), True)
                    return
