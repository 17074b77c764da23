"""The `local` transport: sender and receiver in one process (the colocated engine, unit tests).

Control calls go straight to the receiver object; each layer is copied into the receiver's reserved blocks by
the same checked path the other transports use (a real copy, with its checksum).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from engine.errors import EngineError
from kv_transfer import wire
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import Control, KVSender, Layer
from kv_transfer.state import TransferError, as_transfer_error
from kv_transfer.v1 import kv_transfer_pb2 as pb

_receivers: dict[str, KVReceiver] = {}
_lock = threading.Lock()


def register(name: str, receiver: KVReceiver) -> None:
    """Make a receiver reachable as `local://<name>` in this process."""
    with _lock:
        _receivers[name] = receiver


def unregister(name: str) -> None:
    with _lock:
        _receivers.pop(name, None)


class LocalControl(Control):
    def __init__(self, name: str) -> None:
        with _lock:
            receiver = _receivers.get(name)
        if receiver is None:
            raise TransferError(f"no local KV receiver named {name!r}", retryable=True)
        self.receiver = receiver

    def _call(self, fn, req, request_id: str = ""):  # type: ignore[no-untyped-def]
        try:
            return fn(req)
        except EngineError as e:
            raise as_transfer_error(e, request_id) from None

    def prepare(self, req: pb.PrepareRequest, timeout: float) -> pb.PrepareResponse:
        return self._call(self.receiver.prepare, req, req.request_id)  # type: ignore[no-any-return]

    def commit(self, req: pb.CommitRequest, timeout: float) -> pb.CommitResponse:
        return self._call(self.receiver.commit, req)  # type: ignore[no-any-return]

    def abort(self, req: pb.AbortRequest, timeout: float) -> None:
        self.receiver.abort(req.transfer_id, req.reason)


class LocalKVSender(KVSender):
    """Copies each layer straight into the receiver's reserved blocks."""

    transport = "local"
    control: LocalControl

    def _send_layers(self, layers: Iterator[Layer]) -> None:
        receiver = self.control.receiver
        for layer in layers:
            for which, t in ((0, layer.k), (1, layer.v)):
                t = t.contiguous()
                chunk = pb.KVChunk(transfer_id=self.transfer_id, layer=layer.index, kv=which, first_block=0,
                                   num_blocks=t.shape[0], crc32=wire.crc32(t))
                receiver.on_tensor(chunk, t)
                self.bytes_sent += t.numel() * t.element_size()
