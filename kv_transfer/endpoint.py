"""Choosing a transport by name: `open_sender` on the prefill side, `ReceiverEndpoint` on the decode side."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from engine.kv_export import KVLayout
from engine.llm_engine import LLMEngine
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferConfig, Transport

# transport name → (module, sender class); imported on first use
_SENDERS: dict[Transport, tuple[str, str]] = {
    "grpc": ("kv_transfer.grpc_transport", "GrpcKVSender"),
    "torch": ("kv_transfer.torch_transport", "TorchKVSender"),
    "local": ("kv_transfer.local", "LocalKVSender"),
}


def open_sender(config: TransferConfig, address: str, request_id: str, layout: KVLayout, token_ids: Sequence[int],
                num_prompt_tokens: int, block_hashes: Sequence[bytes], *, sender_id: str = "",
                on_finish: Callable[[KVSender], None] | None = None) -> KVSender:
    """A sender of `config.transport` to the receiver at `address` (host:port, or local://name); not started."""
    module_name, sender_name = _SENDERS[config.transport]
    module = importlib.import_module(module_name)
    if config.transport == "local":
        control = module.LocalControl(address.removeprefix("local://"))
    else:  # torch keeps its control plane on gRPC
        grpc_transport = importlib.import_module("kv_transfer.grpc_transport")
        control = grpc_transport.GrpcControl(address, config.cluster_token, config.tls)
    sender: KVSender = getattr(module, sender_name)(control, config, request_id, layout, token_ids,
                                                    num_prompt_tokens, block_hashes, sender_id=sender_id,
                                                    on_finish=on_finish)
    return sender


class ReceiverEndpoint:
    """Everything a decode worker serves to receive KV: the receiver, its gRPC service, and torch pair groups."""

    def __init__(self, engine: LLMEngine, config: TransferConfig, *,
                 engine_lock: AbstractContextManager[Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 local_name: str | None = None) -> None:
        self.config = config
        self.receiver = KVReceiver(engine, engine_lock)
        self.local_name = local_name
        if config.transport == "local":
            from kv_transfer import local

            self.address = f"local://{local_name or id(self)}"
            local.register(self.address.removeprefix("local://"), self.receiver)
            self.server = None
            return
        from kv_transfer import grpc_transport

        if config.transport == "torch":
            from kv_transfer.torch_transport import TorchEndpoint

            TorchEndpoint(self.receiver, host, config.torch_backend, config.torch_device)
        self.server, bound = grpc_transport.serve(self.receiver, f"{host}:{port}", cluster_token=config.cluster_token,
                                                  kv_tls=config.tls)
        self.address = f"{host}:{bound}"

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
        if self.config.transport == "local":
            from kv_transfer import local

            local.unregister(self.address.removeprefix("local://"))
        self.receiver.close()

