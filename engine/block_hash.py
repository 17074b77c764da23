"""The one block-hash function of pdcluster: prefill, decode and the router all call it.

A block's hash chains its parent's hash, its token ids, the cache scope (model id + KV dtype) and the request's extra
keys (its LoRA adapter: the same tokens give other KV under another adapter), so equal hashes mean equal KV
contents. sha256 with a fixed seed: the same in every process and on every machine.
NOTE: never Python's hash() (salted per process) and never a random per-process seed; both break sharing
KV across processes, which is the whole point of the prefix index.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_ROOT_SEED = b"pdcluster.block-hash.v1"


def cache_scope(model_id: str, kv_dtype: str) -> str:
    """The scope string hashes are computed in: KV is shareable only between identical scopes."""
    return f"{model_id}|{kv_dtype}"


def root_hash(scope: str) -> BlockHash:
    """Parent hash of the first block of every sequence in `scope`."""
    return BlockHash(hashlib.sha256(_ROOT_SEED + scope.encode()).digest())


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], scope: str,
                      extra_keys: str = "") -> BlockHash:
    """Hash of one full block: sha256(parent ‖ scope ‖ tokens as little-endian uint32 [‖ extra keys])."""
    h = hashlib.sha256(parent_hash)
    h.update(scope.encode())
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_keys:
        # NOTE: as vLLM's extra_keys, in every block (not only the root); none leaves the base model's hashes as
        # they were, so the router and the prefix index need no change for requests without an adapter.
        h.update(b"\x00extra:" + extra_keys.encode())
    return BlockHash(h.digest())


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, scope: str, parent: BlockHash | None = None, extra_keys: str = ""
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    prev = parent if parent is not None else root_hash(scope)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block_tokens(prev, token_ids[start : start + block_size], scope, extra_keys)
        hashes.append(prev)
    return hashes
