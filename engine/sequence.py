"""A request's tokens and KV bookkeeping as the scheduler and the model runner see it."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash, hash_block_tokens, root_hash
from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarState

_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks and takes part in steps
    FINISHED = "finished"


class Sequence:
    """One request: prompt + generated tokens, its block table and how much of it has KV computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        scope: str,
        extra_keys: str = "",
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.scope = scope
        self.extra_keys = extra_keys  # block-hash extra keys: its LoRA adapter's key ("" for the base model)
        self.arrival = next(_arrival)
        self.arrival_time = time.monotonic()  # when this engine got it (a prompt's age: engine/step_budget.py)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V sit in block_table
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.num_registered_blocks = 0  # leading full blocks already entered in the prefix cache
        self.num_preemptions = 0
        # NOTE: draft tokens proposed for the next step only (speculative decoding); not part of token_ids until
        # verified, and never sent anywhere.
        self.spec_token_ids: list[int] = []
        self.grammar: GrammarState | None = None  # structured outputs: its matcher (engine/structured_output.py)
        self._hashes: list[BlockHash] = []
        # NOTE: logprobs of the tokens the last step sampled (the runner fills it, the engine drains it), and with
        # params.prompt_logprobs the prompt's, recorded as prefill chunks run ([None] for the first token).
        self.new_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V still has to be computed (prompt chunks, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed_tokens

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def block_hash(self, i: int) -> BlockHash:
        """Chained hash of full block i (computed lazily and memoised; tokens never change once full)."""
        assert (i + 1) * self.block_size <= len(self.token_ids), "only full blocks have a hash"
        while len(self._hashes) <= i:
            j = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else root_hash(self.scope)
            self._hashes.append(hash_block_tokens(parent, self.block_tokens(j), self.scope,
                                                  self.extra_keys))
        return self._hashes[i]

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        return [self.block_hash(i) for i in range(num_blocks)]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
