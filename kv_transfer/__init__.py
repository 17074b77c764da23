"""KV transfer between prefill and decode workers: `open_sender` / `ReceiverEndpoint`, transports by name."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.endpoint import ReceiverEndpoint, open_sender
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender
    from kv_transfer.state import TRANSPORTS, TransferConfig, TransferError, TransferState, Transport

# NOTE: imported on first use: a light submodule (kv_transfer.auth, which the CLI's client uses) must not pull in
# the engine and torch (a second and more before `pdcluster generate --addr` can dial)
_HOME = {"ReceiverEndpoint": "endpoint", "open_sender": "endpoint", "KVReceiver": "receiver", "KVSender": "sender",
         "TRANSPORTS": "state", "TransferConfig": "state", "TransferError": "state", "TransferState": "state",
         "Transport": "state"}

__all__ = ["TRANSPORTS", "KVReceiver", "KVSender", "ReceiverEndpoint", "Transport", "TransferConfig", "TransferError",
           "TransferState", "open_sender"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kv_transfer.{_HOME[name]}"), name)
