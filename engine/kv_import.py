"""Receiving side of the KV seam, in three steps a transfer can spread over time:

1. `reserve`: check what the sender says (layout, tokens, hashes) against this engine, link the leading blocks
   the prefix cache already holds and allocate the rest; nothing is written yet;
2. `write`: store K or V of some blocks of one layer into the reserved blocks (as they arrive, on any thread);
3. `commit`: with the tokens sampled after the KV, turn the reservation into a Sequence ready to decode.
A reservation that never commits (abort, failure, expired lease) is `free`d. Both `commit` and `free` first close
the reservation: they wait for the writes in flight, and every later write is dropped (issue 14, item 3).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields

import torch

from engine.block_hash import BlockHash
from engine.block_manager import BlockManager
from engine.errors import CapacityError, InvalidRequestError, UnknownRequestError
from engine.kv_export import KVLayout
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

# (layer, which, block_ids, kv): stores K (which=0) or V (1), [n, block_size, KVH, D], into the KV memory
WriteBlocks = Callable[[int, int, list[int], torch.Tensor], None]


@dataclass
class KVReservation:
    """Blocks reserved for one request's incoming KV: `start_block` linked from the cache, the rest fresh."""

    seq: Sequence  # token_ids = the tokens whose K/V arrives; not scheduled until commit
    start_block: int  # leading blocks linked from this engine's prefix cache: the sender skips them
    block_hashes: list[BlockHash]
    writers: int = 0  # writes into the fresh blocks in progress (they run outside the engine lock)
    closed: bool = False  # committed or freed: no write may land any more
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

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

    def begin_write(self) -> bool:
        """Count one more write in flight; False once the reservation is closed (the write must be dropped)."""
        with self._cond:
            if self.closed:
                return False
            self.writers += 1
            return True

    def end_write(self) -> None:
        with self._cond:
            self.writers -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse every later write and wait until the writes in flight are done (each is one bounded copy)."""
        with self._cond:
            self.closed = True
            # NOTE: no timeout: giving up here would hand blocks on while a copy may still land in them
            self._cond.wait_for(lambda: self.writers == 0)


class KVImporter:
    """Reserves, writes and commits incoming KV over one engine's block manager and KV memory."""

    def __init__(self, block_manager: BlockManager, write_blocks: WriteBlocks, layout: KVLayout, dtype: torch.dtype,
                 vocab_size: int, max_model_len: int) -> None:
        self.block_manager = block_manager
        self.write_blocks = write_blocks  # NOTE: an attribute so a test can hold a copy mid-way
        self.layout = layout
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def check_layout(self, layout: KVLayout, request_id: str | None) -> None:
        """Every field of the sender's layout must equal this engine's, before anything is reserved."""
        for name in (f.name for f in fields(KVLayout)):
            theirs, ours = getattr(layout, name), getattr(self.layout, name)
            if theirs != ours:
                raise InvalidRequestError(name, f"sender has {theirs!r}, this engine {ours!r}", request_id)

    def _check_tokens(self, name: str, token_ids: Seq[int], request_id: str) -> None:
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(name, f"token ids must be integers in [0, {self.vocab_size})", request_id)

    def reserve(self, request_id: str, layout: KVLayout, token_ids: Seq[int], num_prompt_tokens: int,
                block_hashes: Seq[bytes], extra_keys: str = "") -> KVReservation:
        """Validate an incoming KV payload's description and reserve its blocks (cached leading ones linked);
        `extra_keys`: the block hashes' extra keys (the request's LoRA adapter)."""
        self.check_layout(layout, request_id)
        bs, max_len = layout.block_size, self.max_model_len
        self._check_tokens("token_ids", token_ids, request_id)
        # NOTE: at least one more token (the last one sampled) must fit: a step computes it and samples the next.
        if not 0 < len(token_ids) < max_len - 1:
            raise InvalidRequestError("token_ids", f"{len(token_ids)} KV tokens must be in (0, {max_len - 1}) for "
                                      f"max_model_len {max_len}", request_id)
        if not 0 < num_prompt_tokens <= len(token_ids):
            raise InvalidRequestError("num_prompt_tokens", f"must be in (0, {len(token_ids)}]", request_id)
        if len(block_hashes) != len(token_ids) // bs:
            raise InvalidRequestError("block_hashes", f"one hash per full block is required: "
                                      f"{len(token_ids) // bs}, got {len(block_hashes)}", request_id)
        seq = Sequence(request_id, list(token_ids[:num_prompt_tokens]), SamplingParams(), bs, layout.scope,
                       extra_keys)
        seq.token_ids = list(token_ids)
        hashes = [BlockHash(bytes(h)) for h in block_hashes]
        if seq.block_hashes(len(hashes)) != hashes:
            raise InvalidRequestError("block_hashes", "do not match the token ids sent", request_id)
        bm = self.block_manager
        linked = bm.cached_prefix(hashes, seq.token_ids) if bm.pool.enable_prefix_caching else []
        if not bm.allocate(seq, len(token_ids) - len(linked) * bs, linked):
            raise CapacityError(f"needs {bm.blocks_needed(len(token_ids)) - len(linked)} KV blocks, "
                                f"{bm.num_free_blocks} free", request_id)
        seq.num_computed_tokens = len(token_ids)
        seq.num_registered_blocks = len(linked)
        return KVReservation(seq, len(linked), hashes)

    def write(self, res: KVReservation, layer: int, which: int, first_block: int, kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1) of fresh blocks [first_block, first_block + n) of one layer; kv: [n, bs, KVH, D].

        Raises UnknownRequestError, writing nothing, once the reservation was committed or freed.
        """
        rid = res.request_id
        if not res.begin_write():
            raise UnknownRequestError("the KV reservation was committed or freed: write dropped", rid)
        try:
            fresh, layout = res.fresh_blocks, self.layout
            if not 0 <= layer < layout.num_layers:
                raise InvalidRequestError("layer", f"must be in [0, {layout.num_layers})", rid)
            if which not in (0, 1):
                raise InvalidRequestError("kv", "must be 0 (K) or 1 (V)", rid)
            n = kv.shape[0] if kv.dim() else 0
            if not 0 <= first_block <= first_block + n <= len(fresh):
                raise InvalidRequestError("first_block", f"blocks [{first_block}, {first_block + n}) are not within "
                                          f"the {len(fresh)} reserved", rid)
            if tuple(kv.shape[1:]) != layout.block_shape or kv.dtype != self.dtype:  # int8: scales included
                raise InvalidRequestError("data", f"expected {self.dtype} [n, *{list(layout.block_shape)}], "
                                          f"got {kv.dtype} {list(kv.shape)}", rid)
            self.write_blocks(layer, which, fresh[first_block : first_block + n], kv)
        finally:
            res.end_write()

    def commit(self, res: KVReservation, next_token_ids: Seq[int], params: SamplingParams,
               num_cached_tokens: int = 0) -> Sequence:
        """Append the tokens sampled after the KV (at least one) and hand back a Sequence ready to decode."""
        self.check_commit(res, next_token_ids, params)
        res.close()
        seq = res.seq
        seq.params = params
        seq.token_ids.extend(next_token_ids)
        seq.num_cached_tokens = num_cached_tokens
        self.block_manager.register_full_blocks(seq)
        return seq

    def check_commit(self, res: KVReservation, next_token_ids: Seq[int], params: SamplingParams) -> None:
        """The tokens after the KV and the sampling params must leave something to generate."""
        rid, seq = res.request_id, res.seq
        params.validate()
        self._check_tokens("next_token_ids", next_token_ids, rid)
        total = len(seq.token_ids) + len(next_token_ids)
        if not next_token_ids:
            raise InvalidRequestError("next_token_ids", "at least the last sampled token is required", rid)
        if total >= self.max_model_len:
            raise InvalidRequestError("next_token_ids", f"{total} tokens leave no room to generate within "
                                      f"max_model_len {self.max_model_len}", rid)
        num_sampled = total - seq.num_prompt_tokens
        if params.max_tokens <= num_sampled:
            # NOTE: max_tokens counts the tokens sampled before the transfer; at least one more must be allowed.
            raise InvalidRequestError("max_tokens", f"{params.max_tokens} leaves nothing to generate after the "
                                      f"{num_sampled} token(s) already sampled", rid)

    def free(self, res: KVReservation) -> None:
        """Give a reservation's blocks back (linked ones stay cached), once no write can land in them any more."""
        res.close()
        self.block_manager.free(res.seq)
