"""The sending engine's KV pool (one tensor per TP rank), for transports that read blocks from it themselves (nixl)
instead of copies."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.parallel.shard import kv_heads_of


def pool_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    """The engine's whole KV memory for a transport that moves blocks of it itself (nixl): one tensor per TP rank,
    rank 0 first, each [num_layers, 2, num_blocks, *block_shape] holding that rank's KV heads (one at TP 1).

    NOTE: a TP group's followers' pools are reachable here where rank 0 maps them (a CPU group,
    engine/parallel/shared_pool.py); elsewhere (CUDA, PDCLUSTER_TP_KV=threads) they are in other processes only, and
    the transport must take the seam's copies (`read_kv_layer`, `write_kv_blocks`), as every other transport does.
    """
    runner = engine.runner
    n = engine.config.tensor_parallel_size
    if n == 1:
        return [runner.kv]
    pools = getattr(getattr(runner, "kv_gather", None), "pools", None)
    if not pools:
        raise InvalidRequestError("tensor_parallel_size", f"{n}: the nixl transport reads and writes each rank's KV "
                                  "pool, which this group's rank 0 does not map (only CPU groups do); use the grpc or "
                                  "torch transport")
    return [runner.kv, *(pools[r] for r in range(1, n))]


def pool_heads(engine: LLMEngine) -> list[tuple[int, int]]:
    """The model's KV heads each of `pool_tensors` holds, (first, stop) in rank order (one replicated head per rank
    when the group has more ranks than KV heads)."""
    n = engine.config.tensor_parallel_size
    return [(h.start, h.stop) for h in (kv_heads_of(engine.model_config, r, n) for r in range(n))]


class KVPool:
    """An engine's KV memory as a zero-copy sender reads it: the tensor, a request's block ids, and pins.

    NOTE: a prefill request leaves its engine right after its first token, while the layers it sent may still be
    on their way; the sender pins the blocks it reads (one more reference each) so no other request reuses them
    before its last write completed, and unpins them under the engine lock when it is done.
    """

    def __init__(self, engine: LLMEngine, engine_lock: AbstractContextManager[Any] | None = None) -> None:
        self.engine = engine
        self.engine_lock = engine_lock or threading.RLock()

    @property
    def kvs(self) -> list[torch.Tensor]:
        """One tensor per TP rank, rank 0 first: [num_layers, 2, num_blocks, *block_shape] each (`pool_tensors`)."""
        return pool_tensors(self.engine)

    @property
    def heads(self) -> list[tuple[int, int]]:
        """The KV heads of each of `kvs` (`pool_heads`)."""
        return pool_heads(self.engine)

    def block_ids(self, request_id: str, skip_blocks: int, num_tokens: int) -> list[int]:
        """Blocks holding the first `num_tokens` of a running request, after `skip_blocks` (the engine's thread)."""
        return self.engine.kv_block_ids(request_id, skip_blocks, num_tokens)

    def pin(self, block_ids: list[int]) -> None:
        """Hold `block_ids` (the engine's thread, or under the engine lock)."""
        with self.engine_lock:
            self.engine.pin_kv_blocks(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        with self.engine_lock:
            self.engine.unpin_kv_blocks(block_ids)
