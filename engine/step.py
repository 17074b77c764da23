"""A step as the runner lays it out on the host (`layout`: flat ids, positions, the rows that need logits), and
the decode step a CUDA graph launches ahead of the host (`Lookahead`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.logprobs import prompt_rows
from engine.sampler import SamplerOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass
class Step:
    """A batch laid out for the device (built by `prepare` on the host; `forward` only reads it)."""

    input_ids: list[int]
    positions: list[int]
    starts: list[int]  # per sequence: its tokens computed before this step
    rows: list[int]  # flat indices that need logits: sampled rows, then each verified sequence's rows
    sampling: list[int]  # batch indices of the sequences that sample one token (rows[: len(sampling)])
    verifying: list[int]  # batch indices of the sequences whose drafts are verified (the rows after)
    decode_only: bool  # every sequence computes one token (what a CUDA graph can replay)
    # on the device (None when a CUDA graph takes the step: it copies into its own static buffers)
    meta: AttentionMetadata | None = None
    device_ids: list[torch.Tensor] | None = None  # input ids [T], positions [T], rows [N]
    # prompt logprobs: (batch index, first position, count); their rows come last in `rows`
    scoring: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Lookahead:
    """The decode step after the one just launched, itself launched before that one's sampled ids reached the host
    (CUDA graphs and `EngineConfig.decode_lookahead`): the bet that the scheduler's next batch is the same
    sequences, each one token on, its input ids the sampled ids still on the device. While the host syncs, appends
    and schedules, the GPU computes it. `holds` checks the bet against the step the scheduler then made: won, its
    sampled ids are that step's; lost (a request joined or ended, a block table changed), the GPU did one step of
    work for nothing and the step runs as usual. Either way it wrote only each sequence's next slot, in a block the
    sequence owns, with the token the real step writes there (a sequence that ended instead frees that block).
    """

    seqs: list[Sequence]  # the batch's sequences, in order (compared by identity)
    starts: list[int]  # each one's computed tokens at the step bet on
    tables: list[list[int]]  # each one's block-table blocks the step attends (copies)
    sampled: SamplerOutput  # on the device
    ids: list[int] = field(default_factory=list)  # the step's input ids, once the step before synced them

    def holds(self, batch: ScheduledBatch, step: Step) -> bool:
        """Whether the scheduler's step is the one bet on (a graphed decode step of the same rows and inputs)."""
        return (step.meta is None and len(batch.seqs) == len(self.seqs)
                and all(a is b for a, b in zip(batch.seqs, self.seqs)) and step.starts == self.starts
                and step.input_ids == self.ids
                and all(s.block_table[: len(t)] == t for s, t in zip(batch.seqs, self.tables)))


class NextRow:
    """A sequence as the sampler sees it one token on (its draw's index: the next output's)."""

    __slots__ = ("num_output_tokens", "num_prompt_tokens", "params", "token_ids")

    def __init__(self, seq: Sequence) -> None:
        self.params, self.token_ids, self.num_prompt_tokens = seq.params, seq.token_ids, seq.num_prompt_tokens
        self.num_output_tokens = seq.num_output_tokens + 1


def layout(batch: ScheduledBatch) -> Step:
    """A step's host lists: flat ids and positions, per-sequence starts, the rows that need logits."""
    input_ids: list[int] = []
    positions: list[int] = []
    starts: list[int] = []
    sample_rows: list[int] = []  # flat index of the last token of sequences that sample one token
    sampling: list[int] = []  # their index in the batch
    verifying: list[tuple[int, int]] = []  # (index in the batch, flat index of its first verified row)
    scoring: list[tuple[int, int, int, int]] = []  # prompt logprobs: (batch index, first position, count, row)
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        starts.append(start)
        positions.extend(range(start, start + n))
        draft = seq.spec_token_ids  # NOTE: n counts them: they follow the sequence's last (pending) token
        base = len(input_ids)
        input_ids.extend([*seq.token_ids[start : start + n], *draft])
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            first, count = prompt_rows(seq.num_prompt_tokens, len(seq.prompt_logprobs), start, n)
            if count:
                scoring.append((i, first, count, base + first - start))
        if draft:
            verifying.append((i, len(input_ids) - len(draft) - 1))
        elif start + n == len(seq):
            sample_rows.append(len(input_ids) - 1)
            sampling.append(i)
    # NOTE: one head matmul for every row that needs logits: the head is the largest weight read of a step.
    rows = sample_rows + [r + j for i, r in verifying for j in range(len(batch.seqs[i].spec_token_ids) + 1)]
    rows += [flat + j for _, _, count, flat in scoring for j in range(count)]  # prompt logprobs: after the rest
    decode_only = all(n == 1 for n in batch.num_new_tokens) and len(sampling) == len(batch.seqs)
    return Step(input_ids, positions, starts, rows, sampling, [i for i, _ in verifying], decode_only,
                scoring=[(i, first, count) for i, first, count, _ in scoring])
