"""Logprobs on the host: what a request gets per sampled token and per prompt token.

The sampler (engine/sampler.py) computes them on the logits' device; `sampled_logprobs` reads them back with the
step's one read-back of the sampled tokens. Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` +
`logprobs`) come from extra rows of the prefill's logits: position p's row scores prompt token p + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # NOTE: only the workers compute logprobs; the router (cluster/messages.py) takes the dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """One token's logprob and the most likely alternatives at its position (descending)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), the k most likely
    rank: int | None = None  # 1 + tokens more likely than this one (prompt tokens only)


def sampled_logprobs(tokens: list[int], logprobs: torch.Tensor | None, ids: torch.Tensor | None,
                     wants: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row: the sampled token's logprobs with its `wants[i]` top alternatives (None where it asked for none)."""
    if logprobs is None or ids is None:
        return [None] * len(tokens)
    lp, tid = logprobs.tolist(), ids.tolist()
    return [None if k is None else TokenLogprobs(tok, lp[i][0], list(zip(tid[i][1 : 1 + k], lp[i][1 : 1 + k])))
            for i, (tok, k) in enumerate(zip(tokens, wants))]


def prompt_rows(num_prompt_tokens: int, num_recorded: int, start: int, num_new: int) -> tuple[int, int]:
    """(first, count): the positions of this prefill chunk [start, start + num_new) whose rows score a prompt token
    not yet recorded (position p scores token p + 1; `num_recorded` tokens have an entry, the first one's None)."""
    first = max(start, num_recorded - 1)
    last = min(start + num_new, num_prompt_tokens - 1)  # exclusive; the last prompt position samples instead
    return first, max(0, last - first)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits [M, V] of M positions and the M tokens that followed them → their TokenLogprobs with the top k."""
    import torch

    lp = logits.float().log_softmax(-1)  # [M, V]
    picked = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))  # [M, 1]
    ranks = ((lp > picked).sum(1) + 1).tolist()
    chosen = picked.squeeze(1).tolist()
    if k == 0:
        return [TokenLogprobs(t, c, [], r) for t, c, r in zip(targets, chosen, ranks)]
    top, ids = lp.topk(k, dim=-1)
    return [TokenLogprobs(t, c, list(zip(i, v)), r)
            for t, c, i, v, r in zip(targets, chosen, ids.tolist(), top.tolist(), ranks)]
