"""The `local` transport: sender and receiver in one process (the colocated engine, unit tests).

Control calls go straight to the receiver object; each layer is copied into the receiver's reserved blocks by
the same checked path the other transports use (a real copy, with its checksum).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from engine.errors import EngineError
from kv_transfer import payload
from kv_transfer.messages import Abort, Commit, Prepared, PrepareRequest
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import Control, KVSender, Layer
from kv_transfer.state import TransferError, as_transfer_error

_receivers: dict[str, KVReceiver] = {}
_lock = threading.Lock()
T = TypeVar("T")


def register(name: str, receiver: KVReceiver) -> None:
    """Make a receiver reachable as `local://<name>` in this process."""
    with _lock:
        _receivers[name] = receiver


def unregister(name: str) -> None:
    with _lock:
        _receivers.pop(name, None)


class LocalControl(Control):
    """Control calls as direct calls on a receiver of this process."""

    def __init__(self, name: str) -> None:
        with _lock:
            receiver = _receivers.get(name)
        if receiver is None:
            raise TransferError(f"no local KV receiver named {name!r}", retryable=True)
        self.receiver = receiver

    @staticmethod
    def _call(fn: Callable[[], T], request_id: str = "") -> T:
        try:
            return fn()
        except EngineError as e:
            raise as_transfer_error(e, request_id) from None

    def prepare(self, req: PrepareRequest, timeout: float) -> Prepared:
        return self._call(lambda: self.receiver.prepare(req), req.request_id)

    def commit(self, req: Commit, timeout: float) -> int:
        return self._call(lambda: self.receiver.commit(req))

    def abort(self, req: Abort, timeout: float) -> None:
        self.receiver.abort(req)

    def keep_alive(self, transfer_id: str, timeout: float) -> None:
        self._call(lambda: self.receiver.keep_alive(transfer_id))


class LocalKVSender(KVSender):
    """Copies each layer straight into the receiver's reserved blocks."""

    transport = "local"
    control: LocalControl

    def _send_layers(self, layers: Iterator[Layer]) -> None:
        receiver = self.control.receiver
        for layer in layers:
            for which, t in ((0, layer.k), (1, layer.v)):
                t = t.contiguous()
                receiver.on_tensor(payload.seal(self.transfer_id, layer.index, which, 0, t), t)
                self.bytes_sent += t.numel() * t.element_size()
