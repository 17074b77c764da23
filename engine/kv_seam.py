"""The KV seam of LLMEngine: a prompt's KV read out layer by layer on the sending side, KV prefilled elsewhere adopted
on the receiving side (`reserve_kv` → `write_kv_blocks` as blocks arrive → `commit_kv`).

NOTE: a base class of LLMEngine, split off by concept (llm_engine.py holds the request life cycle); it reads the
engine's request tables, block manager, runner and importer, declared below.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError, UnknownRequestError
from engine.kv_export import KVLayout
from engine.kv_import import KVImporter, KVReservation
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.model_runner import ModelRunner


class KVSeam:
    """The engine's KV hand-off methods (sending: watch_layers, read_kv_layer; receiving: reserve/write/commit)."""

    _seqs: dict[str, Sequence]
    _reserved: dict[str, KVReservation]
    _layer_watchers: dict[str, Callable[[int], None]]
    block_manager: BlockManager
    runner: ModelRunner
    kv_importer: KVImporter

    def _adopt(self, seq: Sequence, sent_chars: int) -> Sequence:
        raise NotImplementedError

    def _check_unused(self, request_id: str) -> None:
        raise NotImplementedError

    def lora_key(self, name: str | None, request_id: str) -> str:
        raise NotImplementedError

    def _layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """Calls the watchers of the sequences whose prompt KV this step completes, after each layer."""
        if not self._layer_watchers:
            return None
        done = [self._layer_watchers.pop(s.request_id) for s, n in zip(batch.seqs, batch.num_new_tokens)
                if s.request_id in self._layer_watchers and s.num_computed_tokens + n >= s.num_prompt_tokens]
        if not done:
            return None

        def hook(layer: int) -> None:
            for fn in done:
                fn(layer)
        return hook

    def read_kv_layer(self, request_id: str, layer: int, skip_blocks: int = 0,
                      num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K and V for the blocks of the first `num_tokens` (default: all computed)."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.block_table:
            raise UnknownRequestError("no KV held for this request", request_id)
        n_blocks = self.block_manager.blocks_needed(seq.num_computed_tokens if num_tokens is None else num_tokens)
        return self.runner.read_blocks(layer, seq.block_table[skip_blocks:n_blocks])

    def kv_block_ids(self, request_id: str, skip_blocks: int = 0, num_tokens: int | None = None) -> list[int]:
        """The pool block ids `read_kv_layer` would copy (for transports that read the KV pool themselves)."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.block_table:
            raise UnknownRequestError("no KV held for this request", request_id)
        n_blocks = self.block_manager.blocks_needed(seq.num_computed_tokens if num_tokens is None else num_tokens)
        return list(seq.block_table[skip_blocks:n_blocks])

    def pin_kv_blocks(self, block_ids: list[int]) -> None:
        """One more reference on held blocks: they are not reused until `unpin_kv_blocks` (a transfer reads them)."""
        for bid in block_ids:
            self.block_manager.pool.acquire(bid)

    def unpin_kv_blocks(self, block_ids: list[int]) -> None:
        self.block_manager.pool.release(block_ids)

    def watch_layers(self, request_id: str, fn: Callable[[int], None]) -> None:
        """Call `fn(layer)` as soon as each layer's KV of the whole prompt is written (layer-wise sending).

        Fires during the step that completes the prompt's prefill, from inside the forward pass: `fn` should only
        copy what it needs (`read_kv_layer(request_id, layer, num_tokens=num_prompt_tokens)`) and hand it on.
        """
        if request_id not in self._seqs:
            raise UnknownRequestError("not a running request", request_id)
        self._layer_watchers[request_id] = fn

    def reserve_kv(self, request_id: str, layout: KVLayout, token_ids: Seq[int], num_prompt_tokens: int,
                   block_hashes: Seq[bytes], lora: str | None = None) -> KVReservation:
        """Check an incoming KV payload's description and reserve blocks for it; cached leading blocks are linked.

        `lora`: the adapter the KV was computed with (loaded here too). NOTE: the sender's hashes carry its adapter's
        key (name + file digest), so KV from an adapter this engine does not hold identically is refused
        ("block_hashes ... do not match"), and its blocks never meet another adapter's in the prefix cache.
        """
        self._check_unused(request_id)
        key = self.lora_key(lora, request_id)
        res = self.kv_importer.reserve(request_id, layout, token_ids, num_prompt_tokens, block_hashes, key)
        self._reserved[request_id] = res
        return res

    def write_kv_blocks(self, res: KVReservation, layer: int, which: int, first_block: int, kv: torch.Tensor) -> None:
        """Write K (which=0) or V (1) of some of a reservation's fresh blocks in one layer; kv: [n, bs, KVH, D].

        NOTE: safe while another thread steps the engine: reserved blocks belong to no scheduled sequence, and
        freeing the reservation waits for this write (a write after the free is dropped with UnknownRequestError).
        """
        self.kv_importer.write(res, layer, which, first_block, kv)

    def commit_kv(self, request_id: str, next_token_ids: Seq[int], params: SamplingParams,
                  num_cached_tokens: int = 0, sent_chars: int = 0) -> Sequence:
        """Turn a fully written reservation into a running request; a failed commit frees the reservation.

        `sent_chars`: characters of the text of `next_token_ids` that the prefill side already streamed.
        """
        res = self._reserved.pop(request_id, None)
        if res is None:
            raise UnknownRequestError("no KV reserved for this request", request_id)
        try:
            if self.lora_key(params.lora, request_id) != res.seq.extra_keys:
                raise InvalidRequestError("lora", f"{params.lora!r} is not the adapter the KV was reserved for",
                                          request_id)
            seq = self.kv_importer.commit(res, next_token_ids, params, num_cached_tokens)
        except BaseException:
            self.kv_importer.free(res)
            raise
        return self._adopt(seq, sent_chars)
