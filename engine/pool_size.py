"""How many KV blocks an engine's pool gets, what one block costs, and the context length it serves (before the
pool caps it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import DEFAULT_KV_CACHE_GB, EngineConfig, ModelConfig
from engine.kv_quant import int8_block_rows
from engine.parallel.shard import rank_config


def kv_cache_dtype(engine_cfg: EngineConfig) -> torch.dtype:
    """How KV is stored: int8 for kv_cache_dtype="int8", else the engine's dtype."""
    return torch.int8 if engine_cfg.kv_cache_dtype == "int8" else engine_cfg.torch_dtype


def kv_block_rows(block_size: int, dtype: torch.dtype) -> int:
    """Rows of one block in the KV memory: its tokens, plus the scale row of an int8 block."""
    return int8_block_rows(block_size) if dtype == torch.int8 else block_size


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers (an int8 block's scales included)."""
    return 2 * cfg.num_layers * kv_block_rows(block_size, dtype) * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass(frozen=True)
class PoolSize:
    """The pool's block count (None: the runner sizes it on CUDA) and the limits it was derived under."""

    num_blocks: int | None
    model_len: int  # max_model_len, capped by the model's positions
    usable: int  # blocks that max_num_seqs full-length sequences could ever use


def pool_size(mcfg: ModelConfig, config: EngineConfig) -> PoolSize:
    """num_blocks when set, else kv_cache_memory_gb (1 GiB on the CPU) over one block's bytes, capped at `usable`.

    NOTE: a TP group's pools are per rank: a block holds one rank's KV heads, so the same memory holds more blocks.
    On CUDA without num_blocks or kv_cache_memory_gb, the runner sizes the pool by gpu_memory_utilization
    (engine/gpu_memory.py).
    """
    per_block = kv_bytes_per_block(rank_config(mcfg, config.tensor_parallel_size), config.block_size,
                                   kv_cache_dtype(config))
    model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    # NOTE: the memory budget is capped at what max_num_seqs full-length sequences could ever use.
    usable = config.max_num_seqs * -(-model_len // config.block_size)
    gb = config.kv_cache_memory_gb
    if gb is None and config.resolved_device().type != "cuda":
        gb = DEFAULT_KV_CACHE_GB
    num_blocks = config.num_blocks or (None if gb is None else max(1, min(usable, int(gb * 2**30 // per_block))))
    return PoolSize(num_blocks, model_len, usable)
