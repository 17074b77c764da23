"""Speculative decoding with n-gram prompt lookup: propose draft tokens from the text so far, verify them in one step.

1. `NgramProposer.propose`: the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up
   in the prompt and the output so far; the tokens that followed their latest earlier occurrence are the draft;
2. the scheduler gives a decoding sequence 1 + len(draft) tokens, and the runner computes them in one pass
   (a verification entry is laid out like a prefill chunk over the cached context);
3. `verify` turns the k + 1 rows of logits into the accepted tokens: the longest prefix of the draft the target
   model agrees with, plus one token from the target model (the correction, or a bonus after a full accept);
4. the engine appends them one by one through the stop checks and rolls back the K/V slots of what was rejected.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from engine.config import SpeculativeConfig
from engine.sampler import filtered_probs, race, step_seed
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


class NgramProposer:
    """Draft tokens by prompt lookup (no draft model): copy what followed the latest match of the last n-gram."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, token_ids: list[int], max_draft: int) -> list[int]:
        """Up to min(k, max_draft) draft tokens continuing `token_ids`; [] when no n-gram matches."""
        k = min(self.k, max_draft)
        if k <= 0:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        size = len(ids)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # NOTE: candidate starts i < size - n, so the match is strictly earlier than the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(ids[: size - 1], n)  # [size - n, n]
            hits = np.flatnonzero((windows == ids[size - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []


def propose_drafts(proposer: NgramProposer, running: Iterable[Sequence], max_model_len: int) -> None:
    """Draft tokens for every decoding sequence of `running`, within its max_tokens and the context length."""
    for seq in running:
        # NOTE: drafts are verified outside the sampler's pipeline: requests that use more than temperature and
        # top-k/top-p decode one token at a time; drafts are not checked by a grammar either
        if seq.num_pending_tokens == 1 and seq.grammar is None and not _needs_sampler(seq.params):
            room = min(seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq))
            seq.spec_token_ids = proposer.propose(seq.token_ids, room)


def _needs_sampler(p: SamplingParams) -> bool:
    """Whether a request uses the sampler's pipeline beyond temperature and top-k/top-p (no speculative drafts)."""
    return p.has_penalties or bool(p.logit_bias) or p.min_p > 0.0 or p.logprobs is not None


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, output_index: int) -> list[int]:
    """Accepted tokens (1 .. len(draft) + 1) from logits [len(draft) + 1, vocab] (row j: after draft[:j]).

    Greedy: draft tokens are kept while each equals the argmax, then the argmax where they differ (or after the
    last), so the output is token for token what decoding one token at a time gives. Sampling: the standard
    rejection rule for a deterministic draft: draft[j] is kept with probability p_j(draft[j]); on a rejection the
    token comes from p_j with draft[j] removed, renormalised; after a full accept, a bonus token from the last row.
    Either way every output token is distributed as the plain sampler's. Draw j uses the request's random stream
    at output index `output_index + j`, as the plain sampler does.
    """
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return [int(t) for t in target[: accepted + 1]]
    out: list[int] = []
    for j in range(len(draft) + 1):
        probs = filtered_probs(logits[j], params)  # [vocab]
        # NOTE: a generator of the logits' device, as the plain sampler's (a CPU one cannot draw on a GPU)
        gen = torch.Generator(device=logits.device).manual_seed(
            step_seed(params.seed or 0, output_index + j + params.output_offset))
        if j < len(draft):
            if float(torch.rand((), generator=gen, device=logits.device)) < float(probs[draft[j]]):
                out.append(draft[j])
                continue
            probs = probs.clone()
            probs[draft[j]] = 0.0  # the residual max(0, p - q) of a one-hot draft q
            if float(probs.sum()) <= 0.0:  # NOTE: p was (numerically) all on the draft token: keep it
                out.append(draft[j])
                break
        out.append(int(race(probs, gen)))
        break
    return out
