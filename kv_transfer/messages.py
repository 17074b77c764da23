"""What sender and receiver say to each other, as plain typed values (protobuf only on the wire: see wire.py).

One message per step of a transfer (the proto's header comment has the whole life of one):
1. `PrepareRequest` → `Prepared` (with a `TorchRendezvous` for transport "torch", a `NixlTarget` for "nixl");
2. `Chunk`s: K or V of some blocks of one layer, each sealed with a CRC32C of its place and bytes;
3. `Commit` → bytes received; or `Abort` from either side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_export import KVLayout
from kv_transfer.state import Transport


@dataclass(frozen=True, slots=True)
class PrepareRequest:
    """The sender describes the payload; the receiver checks every field before it reserves a block."""

    request_id: str
    layout: KVLayout
    token_ids: list[int]  # tokens whose K/V is sent
    num_prompt_tokens: int
    block_hashes: list[bytes]  # chained hash of every full block among token_ids
    transport: Transport
    deadline_ms: int  # the receiver frees its reservation if the transfer has not committed by then
    sender_id: str = ""  # identifies the sender's end of a torch.distributed pair group
    nixl_agent: str = ""  # nixl: the sender's agent name (its Watch is open)
    nixl_known: str = ""  # nixl: the receiver agent whose metadata the sender already holds
    attempt_id: str = ""  # the sender's id of this handshake (an `Abort` naming it frees what it reserved)
    lora: str = ""  # the LoRA adapter the KV was computed with ("": the base model); the block hashes carry its key
    nixl_shards: int = 1  # nixl: the pools the sender writes from, one per TP rank
    # nixl: the KV heads each of those pools holds, (first, stop) in rank order (replicated heads appear twice;
    # none: the split a TP group of nixl_shards ranks makes, engine/parallel/shard.py)
    nixl_heads: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TorchRendezvous:
    """Where a torch.distributed pair group meets: a TCPStore on the receiver, a key per pair."""

    host: str
    port: int
    group_key: str  # a new key means a new group (the old one is discarded)
    backend: str  # "gloo" | "nccl"
    tag: int  # send/recv tag of this transfer within the pair
    device: str  # device of the tensors sent ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class NixlTarget:
    """Where a nixl sender writes: the receiver's agent, its registered KV pool, the reserved block ids."""

    agent: str  # a new name means the receiver restarted (its metadata must be loaded again)
    metadata: bytes  # empty when the sender said it holds this agent's metadata
    kv_addr: int  # the pool [num_layers, 2, pool_blocks, *block_shape]
    pool_blocks: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    block_ids: list[int]  # the reserved blocks after the cached ones, in order
    shard_addrs: list[int] = field(default_factory=list)  # a TP group's pools of ranks 1 .. n-1 (kv_addr: rank 0's)
    cuda_ipc: bytes = b""  # a GPU pool shared through CUDA IPC (transports/cuda_ipc.py; empty: none)
    shard_heads: list[tuple[int, int]] = field(default_factory=list)  # the KV heads of each rank's pool, rank 0 first


@dataclass(frozen=True, slots=True)
class Prepared:
    """The receiver's answer: blocks reserved, how many leading ones it caches (not sent)."""

    transfer_id: str
    cached_blocks: int  # leading blocks the receiver linked from its prefix cache
    num_blocks: int  # blocks to send per layer (K and V each)
    torch: TorchRendezvous | None = None  # set for transport "torch"
    nixl: NixlTarget | None = None  # set for transport "nixl"


@dataclass(frozen=True, slots=True)
class Chunk:
    """K or V of blocks [first_block, first_block + num_blocks) (among those sent) of one layer; data travels beside."""

    transfer_id: str
    layer: int
    kv: int  # 0 = K, 1 = V
    first_block: int
    num_blocks: int
    crc32c: int  # of the place, then the data ([num_blocks, *block_shape], native byte order): payload.seal

    def where(self) -> str:
        """The chunk's place, as errors name it."""
        last = self.first_block + self.num_blocks
        return f"layer {self.layer} {'KV'[self.kv % 2]} blocks [{self.first_block}, {last})"


@dataclass(frozen=True, slots=True)
class Commit:
    """The sender is done: the tokens sampled after the K/V sent."""

    transfer_id: str
    next_token_ids: list[int] = field(default_factory=list)  # at least the first sampled token
    num_cached_tokens: int = 0  # prompt tokens the sender served from its own prefix cache


@dataclass(frozen=True, slots=True)
class Abort:
    """Either side stops the transfer; the receiver frees its reservation."""

    transfer_id: str
    reason: str
    quiesced: bool = False  # nixl, from the sender: none of its writes into the transfer's blocks is in flight
    # instead of transfer_id: the handshake (`PrepareRequest.attempt_id`) the sender gave up before its answer came
    attempt_id: str = ""
