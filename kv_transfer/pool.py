"""The sending engine's KV pool, for transports that read blocks from it themselves (nixl) instead of copies."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine


def pool_tensor(engine: LLMEngine) -> torch.Tensor:
    """The engine's whole KV memory, [num_layers, 2, num_blocks, *block_shape], for a transport that moves blocks of
    it itself (nixl); refused for a TP group, whose pool is split over its ranks' processes.

    NOTE: rank 0's tensor holds only its own KV heads; the seam's copies (`read_kv_layer`, `write_kv_blocks`, which
    every other transport uses) carry all of them (engine/parallel/kv.py). Per-rank registration is a later step.
    """
    n = engine.config.tensor_parallel_size
    if n > 1:
        raise InvalidRequestError("tensor_parallel_size", f"{n}: the nixl transport reads and writes the KV pool "
                                  "itself, and a TP group's is split over its ranks; use the grpc or torch transport")
    kv: torch.Tensor = engine.runner.kv
    return kv


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
    def kv(self) -> torch.Tensor:
        """[num_layers, 2, num_blocks, *block_shape]"""
        return pool_tensor(self.engine)

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
