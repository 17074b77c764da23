"""Receiving side of the KV seam: check an export against this engine, then link, allocate and write."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import CapacityError, InvalidRequestError
from engine.kv_export import KVExport
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def validate_export(engine: LLMEngine, kv: KVExport) -> None:
    """Everything the receiver is told must match it, before any byte is written."""
    rid, cfg = kv.request_id, engine.model_config
    if kv.scope != engine.scope:
        raise InvalidRequestError("scope", f"KV of {kv.scope!r} cannot be used by {engine.scope!r}", rid)
    if kv.block_size != engine.config.block_size:
        raise InvalidRequestError("block_size", f"{kv.block_size} != {engine.config.block_size}", rid)
    if kv.num_layers != cfg.num_layers or len(kv.v) != cfg.num_layers:
        raise InvalidRequestError("num_layers", f"{kv.num_layers} != {cfg.num_layers}", rid)
    if len(kv.token_ids) >= engine.max_model_len:
        raise InvalidRequestError("token_ids", f"{len(kv.token_ids)} tokens leave no room to generate within "
                                  f"max_model_len {engine.max_model_len}", rid)
    if any(not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in kv.token_ids):
        raise InvalidRequestError("token_ids", f"token ids must be integers in [0, {cfg.vocab_size})", rid)
    # NOTE: at least the last sampled token has no K/V yet: a step computes it and samples the next one.
    # A sequence with nothing left to compute would be scheduled for 0 tokens and sample from another row.
    if not 0 < kv.num_kv_tokens < len(kv.token_ids):
        raise InvalidRequestError("num_kv_tokens", f"{kv.num_kv_tokens} must be in (0, {len(kv.token_ids)}): "
                                  "the tokens sent, less at least the last one", rid)
    if not 0 < kv.num_prompt_tokens <= kv.num_kv_tokens:
        raise InvalidRequestError("num_prompt_tokens", "must be in (0, num_kv_tokens]", rid)
    if len(kv.block_hashes) != kv.num_kv_tokens // kv.block_size:
        raise InvalidRequestError("block_hashes", "one hash per full block is required", rid)
    if not 0 <= kv.start_block <= len(kv.block_hashes):
        raise InvalidRequestError("start_block", "must point at a full block", rid)
    dtypes = {t.dtype for t in (*kv.k, *kv.v)}
    if dtypes != {engine.runner.dtype}:
        raise InvalidRequestError("dtype", f"KV tensors must be {engine.runner.dtype}, got {sorted(map(str, dtypes))}",
                                  rid)
    shape = (kv.num_blocks - kv.start_block, kv.block_size, cfg.num_kv_heads, cfg.head_dim)
    for name, tensors in (("k", kv.k), ("v", kv.v)):
        for t in tensors:
            if tuple(t.shape) != shape:
                raise InvalidRequestError(name, f"expected shape {shape}, got {tuple(t.shape)}", rid)


def import_sequence(engine: LLMEngine, kv: KVExport, params: SamplingParams) -> Sequence:
    """Build a running Sequence whose KV is `kv`: cached leading blocks are linked, the rest written."""
    validate_export(engine, kv)
    num_sampled = len(kv.token_ids) - kv.num_prompt_tokens
    if params.max_tokens <= num_sampled:
        # NOTE: max_tokens counts the tokens sampled before the export; at least one more must be allowed.
        raise InvalidRequestError("max_tokens", f"{params.max_tokens} leaves nothing to generate after the "
                                  f"{num_sampled} token(s) already sampled", kv.request_id)
    bm, bs = engine.block_manager, kv.block_size
    seq = Sequence(kv.request_id, kv.token_ids[: kv.num_prompt_tokens], params, bs, engine.scope)
    seq.token_ids = list(kv.token_ids)
    if seq.block_hashes(len(kv.block_hashes)) != kv.block_hashes:
        raise InvalidRequestError("block_hashes", "do not match the token ids sent", kv.request_id)
    linked = bm.cached_prefix(kv.block_hashes[: kv.start_block], seq.token_ids)
    if len(linked) < kv.start_block:
        raise CapacityError(f"block {len(linked)} was left out but is no longer cached here", kv.request_id)
    if not bm.allocate(seq, kv.num_kv_tokens - kv.start_block * bs, linked):
        raise CapacityError(f"needs {kv.num_blocks - kv.start_block} KV blocks, {bm.num_free_blocks} free",
                            kv.request_id)
    fresh = seq.block_table[kv.start_block :]
    for layer in range(kv.num_layers):
        engine.runner.write_blocks(layer, fresh, kv.k[layer], kv.v[layer])
    seq.num_computed_tokens = kv.num_kv_tokens
    seq.num_cached_tokens = kv.num_cached_tokens
    bm.register_full_blocks(seq)
    return seq
