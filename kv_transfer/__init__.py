"""KV transfer between prefill and decode workers: `open_sender` / `ReceiverEndpoint`, transports by name."""

from kv_transfer.endpoint import ReceiverEndpoint, open_sender, send_held_kv
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferConfig, TransferError, TransferState

__all__ = ["KVReceiver", "KVSender", "ReceiverEndpoint", "TransferConfig", "TransferError", "TransferState",
           "open_sender", "send_held_kv"]
