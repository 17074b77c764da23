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
