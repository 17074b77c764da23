"""Receiving side of the KV seam, in three steps a transfer can spread over time:

1. `reserve`: check what the sender says (layout, tokens, hashes) against this engine, link the leading blocks
   the prefix cache already holds and allocate the rest; nothing is written yet;
2. `write_blocks`: store K or V of some blocks of one layer into the reserved blocks (as they arrive);
3. `commit`: with the tokens sampled after the KV, turn the reservation into a Sequence ready to decode.
Freeing a reservation that never commits (abort, failure, expired lease) is `BlockManager.free` on its sequence.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_hash import BlockHash
from engine.errors import CapacityError, InvalidRequestError
from engine.kv_export import KVExport, KVLayout
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


@dataclass
class KVReservation:
    """Blocks reserved for one request's incoming KV: `start_block` linked from the cache, the rest fresh."""

    seq: Sequence  # token_ids = the tokens whose K/V arrives; not scheduled until commit
    start_block: int  # leading blocks linked from this engine's prefix cache: the sender skips them
    block_hashes: list[BlockHash]

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_kv_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def fresh_blocks(self) -> list[int]:
        """Block ids to write, in order: blocks [start_block, num_blocks) of the sequence."""
        return self.seq.block_table[self.start_block :]


def check_layout(engine: LLMEngine, layout: KVLayout, request_id: str | None) -> None:
    """Every field of the sender's layout must equal this engine's, before anything is reserved."""
    mine = engine.kv_layout
    for field in ("scope", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim"):
        theirs, ours = getattr(layout, field), getattr(mine, field)
        if theirs != ours:
            raise InvalidRequestError(field, f"sender has {theirs!r}, this engine {ours!r}", request_id)


def _check_tokens(engine: LLMEngine, field: str, token_ids: Seq[int], request_id: str) -> None:
    vocab = engine.model_config.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
        raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab})", request_id)


def reserve(engine: LLMEngine, request_id: str, layout: KVLayout, token_ids: Seq[int], num_prompt_tokens: int,
            block_hashes: Seq[bytes], cached_blocks: int | None = None) -> KVReservation:
    """Validate an incoming KV payload's description and reserve its blocks.

    `cached_blocks=None` links as many leading blocks as the prefix cache holds (the receiver decides);
    an integer requires exactly that many to be cached (the sender already left them out).
    """
    check_layout(engine, layout, request_id)
    bs = layout.block_size
    _check_tokens(engine, "token_ids", token_ids, request_id)
    # NOTE: at least one more token (the last one sampled) must fit: a step computes it and samples the next.
    if not 0 < len(token_ids) < engine.max_model_len - 1:
        raise InvalidRequestError("token_ids", f"{len(token_ids)} KV tokens must be in (0, "
                                  f"{engine.max_model_len - 1}) for max_model_len {engine.max_model_len}", request_id)
    if not 0 < num_prompt_tokens <= len(token_ids):
        raise InvalidRequestError("num_prompt_tokens", f"must be in (0, {len(token_ids)}]", request_id)
    if len(block_hashes) != len(token_ids) // bs:
        raise InvalidRequestError("block_hashes", f"one hash per full block is required: "
                                  f"{len(token_ids) // bs}, got {len(block_hashes)}", request_id)
    seq = Sequence(request_id, list(token_ids[:num_prompt_tokens]), SamplingParams(), bs, engine.scope)
    seq.token_ids = list(token_ids)
    hashes = [BlockHash(bytes(h)) for h in block_hashes]
    if seq.block_hashes(len(hashes)) != hashes:
        raise InvalidRequestError("block_hashes", "do not match the token ids sent", request_id)
    bm = engine.block_manager
    linked = bm.cached_prefix(hashes, seq.token_ids) if bm.pool.enable_prefix_caching else []
    if cached_blocks is not None:
        if not 0 <= cached_blocks <= len(hashes):
            raise InvalidRequestError("start_block", f"must be in [0, {len(hashes)}]", request_id)
        if len(linked) < cached_blocks:
            raise CapacityError(f"block {len(linked)} was left out but is no longer cached here", request_id)
        linked = linked[:cached_blocks]
    if not bm.allocate(seq, len(token_ids) - len(linked) * bs, linked):
        raise CapacityError(f"needs {bm.blocks_needed(len(token_ids)) - len(linked)} KV blocks, "
                            f"{bm.num_free_blocks} free", request_id)
    seq.num_computed_tokens = len(token_ids)
    seq.num_registered_blocks = len(linked)
    return KVReservation(seq, len(linked), hashes)


def check_layer(engine: LLMEngine, res: KVReservation, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's K and V must be [len(fresh_blocks), block_size, KVH, D] in this engine's dtype."""
    layout, rid = engine.kv_layout, res.request_id
    if not 0 <= layer < layout.num_layers:
        raise InvalidRequestError("layer", f"must be in [0, {layout.num_layers})", rid)
    shape = (len(res.fresh_blocks), *layout.block_shape)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or t.dtype != engine.runner.dtype:
            raise InvalidRequestError(name, f"expected {engine.runner.dtype} {shape}, got {t.dtype} "
                                      f"{tuple(t.shape)}", rid)


def write_blocks(engine: LLMEngine, res: KVReservation, layer: int, which: int, first_block: int,
                 kv: torch.Tensor) -> None:
    """Store K (which=0) or V (1) of fresh blocks [first_block, first_block + n) of one layer; kv: [n, bs, KVH, D]."""
    layout, rid, fresh = engine.kv_layout, res.request_id, res.fresh_blocks
    if not 0 <= layer < layout.num_layers:
        raise InvalidRequestError("layer", f"must be in [0, {layout.num_layers})", rid)
    if which not in (0, 1):
        raise InvalidRequestError("kv", "must be 0 (K) or 1 (V)", rid)
    n = kv.shape[0] if kv.dim() else 0
    if not 0 <= first_block <= first_block + n <= len(fresh):
        raise InvalidRequestError("first_block", f"blocks [{first_block}, {first_block + n}) are not within the "
                                  f"{len(fresh)} reserved", rid)
    if tuple(kv.shape[1:]) != layout.block_shape or kv.dtype != engine.runner.dtype:
        raise InvalidRequestError("data", f"expected {engine.runner.dtype} [n, *{list(layout.block_shape)}], "
                                  f"got {kv.dtype} {list(kv.shape)}", rid)
    engine.runner.write_blocks(layer, which, fresh[first_block : first_block + n], kv)


def commit(engine: LLMEngine, res: KVReservation, next_token_ids: Seq[int], params: SamplingParams,
           num_cached_tokens: int = 0) -> Sequence:
    """Append the tokens sampled after the KV (at least one) and hand back a Sequence ready to decode."""
    check_commit(engine, res, next_token_ids, params)
    seq = res.seq
    seq.params = params
    seq.token_ids.extend(next_token_ids)
    seq.num_cached_tokens = num_cached_tokens
    engine.block_manager.register_full_blocks(seq)
    return seq


def check_commit(engine: LLMEngine, res: KVReservation, next_token_ids: Seq[int], params: SamplingParams) -> None:
    """The tokens after the KV and the sampling params must leave something to generate."""
    rid, seq = res.request_id, res.seq
    params.validate()
    _check_tokens(engine, "next_token_ids", next_token_ids, rid)
    total = len(seq.token_ids) + len(next_token_ids)
    if not next_token_ids:
        raise InvalidRequestError("next_token_ids", "at least the last sampled token is required", rid)
    if total >= engine.max_model_len:
        raise InvalidRequestError("next_token_ids", f"{total} tokens leave no room to generate within "
                                  f"max_model_len {engine.max_model_len}", rid)
    num_sampled = total - seq.num_prompt_tokens
    if params.max_tokens <= num_sampled:
        # NOTE: max_tokens counts the tokens sampled before the transfer; at least one more must be allowed.
        raise InvalidRequestError("max_tokens", f"{params.max_tokens} leaves nothing to generate after the "
                                  f"{num_sampled} token(s) already sampled", rid)


def import_export(engine: LLMEngine, kv: KVExport, params: SamplingParams) -> Sequence:
    """Reserve, write and commit a whole KVExport at once (the in-process path)."""
    rid, n_kv = kv.request_id, kv.num_kv_tokens
    _check_tokens(engine, "token_ids", kv.token_ids, rid)
    if not 0 < n_kv < len(kv.token_ids):
        raise InvalidRequestError("num_kv_tokens", f"{n_kv} must be in (0, {len(kv.token_ids)}): "
                                  "the tokens sent, less at least the last one", rid)
    if kv.num_layers != engine.kv_layout.num_layers or len(kv.v) != kv.num_layers:
        raise InvalidRequestError("num_layers", f"{kv.num_layers} != {engine.kv_layout.num_layers}", rid)
    res = reserve(engine, rid, kv.layout, kv.token_ids[:n_kv], kv.num_prompt_tokens, kv.block_hashes,
                  cached_blocks=kv.start_block)
    try:
        # NOTE: everything is checked before the first layer is written
        check_commit(engine, res, kv.token_ids[n_kv:], params)
        for layer in range(kv.num_layers):
            check_layer(engine, res, layer, kv.k[layer], kv.v[layer])
        for layer in range(kv.num_layers):
            engine.runner.write_blocks(layer, 0, res.fresh_blocks, kv.k[layer])
            engine.runner.write_blocks(layer, 1, res.fresh_blocks, kv.v[layer])
        return commit(engine, res, kv.token_ids[n_kv:], params, kv.num_cached_tokens)
    except BaseException:
        engine.block_manager.free(res.seq)
        raise
