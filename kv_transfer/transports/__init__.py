"""The transports, registered by name and imported on first use (as vLLM registers its KV connectors).

Each transport is a module here with a `KVSender` subclass (the prefill side) and, where the receiver needs more
than the gRPC KV service, a receiver-side hook made next to it (`torch`: the pair groups; `nixl`: the agent and its
notifications). Control (handshake, keep-alive, commit, abort) is gRPC for every remote transport; `local` calls
the receiver directly (same process).

| name | module | data path |
| --- | --- | --- |
| `grpc` | `grpc_transport.py` | sealed 1 MiB chunks over parallel gRPC streams |
| `torch` | `torch_transport.py` (+ `torch_pairs.py`, `liveness.py`) | torch.distributed send/recv per pair |
| `nixl` | `nixl_transport.py` (+ `nixl_agent.py`, `nixl_receiver.py`, `nixl_load.py`) | NIXL WRITE from the KV pool |
| `local` | `local.py` | a checked copy within one process |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender
    from kv_transfer.state import TransferConfig


@dataclass(frozen=True)
class Entry:
    """Where a transport lives; nothing is imported until it is used."""

    module: str
    sender: str  # its KVSender subclass
    receiver_side: str | None = None  # fn(receiver, config, host) -> hook with close(), set up beside the gRPC service
    unavailable: str | None = None  # fn() -> why it cannot run in this process (None: it can)
    # NOTE: the module holding `unavailable` when not `module`: the router's process asks without importing the
    # transport (and with it the engine and torch)
    checks: str | None = None


_REGISTRY: dict[str, Entry] = {}


def register(name: str, entry: Entry) -> None:
    """Make a transport known by `name` (a later registration of the same name replaces it)."""
    _REGISTRY[name] = entry


def _attr(name: str, attr: str) -> Any:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"transport: unknown {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return getattr(importlib.import_module(entry.module), attr)


def sender_class(name: str) -> type[KVSender]:
    """The KVSender subclass of transport `name` (its module imported now)."""
    cls: type[KVSender] = _attr(name, _REGISTRY[name].sender if name in _REGISTRY else "")
    return cls


def receiver_side(name: str, receiver: KVReceiver, config: TransferConfig, host: str) -> Any | None:
    """Set up what transport `name` needs on the receiving side beside the gRPC service (None: nothing)."""
    entry = _REGISTRY[name]
    if entry.receiver_side is None:
        return None
    make: Callable[..., Any] = _attr(name, entry.receiver_side)
    return make(receiver, config, host)


def unavailable(name: str) -> str | None:
    """Why transport `name` cannot run in this process (a package missing), or None."""
    entry = _REGISTRY[name]
    if entry.unavailable is None:
        return None
    check: Callable[[], str | None] = getattr(importlib.import_module(entry.checks or entry.module),
                                              entry.unavailable)
    return check()


register("grpc", Entry("kv_transfer.transports.grpc_transport", "GrpcKVSender"))
register("torch", Entry("kv_transfer.transports.torch_transport", "TorchKVSender", "receiver_side"))
register("local", Entry("kv_transfer.transports.local", "LocalKVSender"))
register("nixl", Entry("kv_transfer.transports.nixl_transport", "NixlKVSender", "receiver_side", "unavailable",
                      "kv_transfer.transports.nixl_load"))
