"""KV transfer between prefill and decode workers: `open_sender` / `ReceiverEndpoint`, transports by name."""

from kv_transfer.endpoint import ReceiverEndpoint, open_sender
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TRANSPORTS, TransferConfig, TransferError, TransferState, Transport

__all__ = ["TRANSPORTS", "KVReceiver", "KVSender", "ReceiverEndpoint", "Transport", "TransferConfig", "TransferError",
           "TransferState", "open_sender"]
