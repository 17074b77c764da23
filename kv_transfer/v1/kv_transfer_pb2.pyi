from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("scope", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    scope: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, scope: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("request_id", "layout", "token_ids", "num_prompt_tokens", "block_hashes", "transport", "deadline_ms", "sender_id", "nixl_agent", "nixl_known", "attempt_id", "lora", "nixl_shards", "nixl_heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    NIXL_KNOWN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    NIXL_SHARDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    transport: str
    deadline_ms: int
    sender_id: str
    nixl_agent: str
    nixl_known: str
    attempt_id: str
    lora: str
    nixl_shards: int
    nixl_heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., transport: _Optional[str] = ..., deadline_ms: _Optional[int] = ..., sender_id: _Optional[str] = ..., nixl_agent: _Optional[str] = ..., nixl_known: _Optional[str] = ..., attempt_id: _Optional[str] = ..., lora: _Optional[str] = ..., nixl_shards: _Optional[int] = ..., nixl_heads: _Optional[_Iterable[int]] = ...) -> None: ...

class NixlTarget(_message.Message):
    __slots__ = ("agent", "metadata", "kv_addr", "pool_blocks", "mem_type", "device_id", "block_ids", "shard_addrs", "cuda_ipc", "shard_heads")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_ADDR_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_ADDRS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHARD_HEADS_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    kv_addr: int
    pool_blocks: int
    mem_type: str
    device_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    shard_addrs: _containers.RepeatedScalarFieldContainer[int]
    cuda_ipc: bytes
    shard_heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., kv_addr: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., shard_addrs: _Optional[_Iterable[int]] = ..., cuda_ipc: _Optional[bytes] = ..., shard_heads: _Optional[_Iterable[int]] = ...) -> None: ...

class TorchRendezvous(_message.Message):
    __slots__ = ("host", "port", "group_key", "backend", "tag", "device")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    group_key: str
    backend: str
    tag: int
    device: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., group_key: _Optional[str] = ..., backend: _Optional[str] = ..., tag: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("transfer_id", "cached_blocks", "num_blocks", "torch", "nixl")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    cached_blocks: int
    num_blocks: int
    torch: TorchRendezvous
    nixl: NixlTarget
    def __init__(self, transfer_id: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., torch: _Optional[_Union[TorchRendezvous, _Mapping]] = ..., nixl: _Optional[_Union[NixlTarget, _Mapping]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("transfer_id", "layer", "kv", "first_block", "num_blocks", "crc32c", "data")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    kv: int
    first_block: int
    num_blocks: int
    crc32c: int
    data: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., kv: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., crc32c: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("transfer_id", "next_token_ids", "num_cached_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, transfer_id: _Optional[str] = ..., next_token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("transfer_id", "reason", "quiesced", "attempt_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUIESCED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    quiesced: bool
    attempt_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., quiesced: _Optional[bool] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: str
    def __init__(self, agent: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
