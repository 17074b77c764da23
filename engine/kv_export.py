"""The KV seam between engines: export a prefilled sequence's blocks, import them elsewhere and decode on.

An export carries, per layer, K and V of the sequence's blocks plus everything the receiver needs to check
before it writes a byte: cache scope (model id + dtype), block size, layer count, shapes, token ids and the
chained block hashes. Leading blocks the receiver already caches can be left out (`start_block`): the
receiver links its own copies instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash


@dataclass(frozen=True)
class KVLayout:
    """What KV blocks must match to be written into an engine's pool (sent first in every transfer)."""

    scope: str  # model id and KV dtype: only an engine with the same scope may use the blocks
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of K and V of `num_blocks` blocks in one layer."""
        return 2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize


@dataclass
class KVExport:
    """KV blocks of one sequence, as tensors plus the metadata to validate and resume them."""

    request_id: str
    scope: str  # cache scope: model id and KV dtype; only an engine with the same scope may import
    block_size: int
    token_ids: list[int]  # prompt + tokens sampled so far
    num_prompt_tokens: int
    num_kv_tokens: int  # leading tokens whose K/V is included (or cached on the receiver)
    block_hashes: list[BlockHash]  # hashes of the full blocks among the KV tokens
    start_block: int  # blocks [0, start_block) are not included: the receiver holds them in its cache
    k: list[torch.Tensor]  # per layer: [num_blocks - start_block, block_size, KVH, D]
    v: list[torch.Tensor]
    num_cached_tokens: int = 0  # prompt tokens the exporting engine served from its own prefix cache

    @property
    def num_blocks(self) -> int:
        return -(-self.num_kv_tokens // self.block_size)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def layout(self) -> KVLayout:
        """The layout these tensors have (the receiver checks it against its own)."""
        _, bs, kvh, d = self.k[0].shape
        return KVLayout(self.scope, str(self.dtype).removeprefix("torch."), self.num_layers, self.block_size, kvh, d)
