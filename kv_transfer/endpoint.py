"""Choosing a transport by name: `open_sender` on the prefill side, `ReceiverEndpoint` on the decode side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from engine.kv_export import KVLayout
from engine.llm_engine import LLMEngine
from kv_transfer import transports
from kv_transfer.pool import KVPool
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import Control, KVSender
from kv_transfer.state import TransferConfig


def open_sender(config: TransferConfig, address: str, request_id: str, layout: KVLayout, token_ids: Sequence[int],
                num_prompt_tokens: int, block_hashes: Sequence[bytes], *, sender_id: str = "",
                on_finish: Callable[[KVSender], None] | None = None, pool: KVPool | None = None,
                lora: str = "") -> KVSender:
    """A sender of `config.transport` to the receiver at `address` (host:port, or local://name); not started.

    `pool`: the sending engine's KV pool, for transports that read blocks from it themselves (`sender.reads_pool`:
    hand them block ids with `send_blocks` instead of copies with `send_layer`). `lora`: the adapter the KV was
    computed with ("": the base model; `block_hashes` carry its key).
    """
    control: Control
    if config.transport == "local":
        from kv_transfer.transports import local

        control = local.LocalControl(address.removeprefix("local://"))
    else:  # every remote transport keeps its control plane on gRPC
        from kv_transfer.transports.grpc_control import GrpcControl

        control = GrpcControl(address, config.cluster_token, config.tls)
    sender = transports.sender_class(config.transport)(control, config, request_id, layout, token_ids,
                                                       num_prompt_tokens, block_hashes, sender_id=sender_id,
                                                       on_finish=on_finish)
    sender.pool, sender.lora = pool, lora
    return sender


class ReceiverEndpoint:
    """Everything a decode worker serves to receive KV: the receiver, its gRPC service, the transport's own side."""

    def __init__(self, engine: LLMEngine, config: TransferConfig, *,
                 engine_lock: AbstractContextManager[Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 local_name: str | None = None) -> None:
        self.config = config
        self.receiver = KVReceiver(engine, engine_lock)
        self.local_name = local_name
        self.side: Any | None = None
        if config.transport == "local":
            from kv_transfer.transports import local

            self.address = f"local://{local_name or id(self)}"
            local.register(self.address.removeprefix("local://"), self.receiver)
            self.server = None
            return
        from kv_transfer.transports import grpc_transport

        self.side = transports.receiver_side(config.transport, self.receiver, config, host)
        self.server, bound = grpc_transport.serve(self.receiver, f"{host}:{port}", cluster_token=config.cluster_token,
                                                  kv_tls=config.tls)
        self.address = f"{host}:{bound}"

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
        if self.config.transport == "local":
            from kv_transfer.transports import local

            local.unregister(self.address.removeprefix("local://"))
        self.receiver.close()
        if (close := getattr(self.side, "close", None)) is not None:
            close()
