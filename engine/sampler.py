"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

NOTE: the random stream of a request is a pure function of (seed, output index), not a stateful generator,
so a request sampled partly on a prefill worker and partly on a decode worker draws the same tokens as one
that ran in a single engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, index: int) -> int:
    """Seed of the draw for output token `index` of a request seeded with `seed`."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & _MASK64


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [V] → [V]
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] → [V]
    """The distribution a non-greedy request samples from: temperature, then top-k and top-p."""
    return _filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p).softmax(-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], output_index: Sequence[int]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(logits[i], p)
        gen = torch.Generator().manual_seed(step_seed(p.seed or 0, output_index[i] + p.output_offset))
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), draws index i with probability p_i.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[i] = int((probs / noise).argmax())
    return tokens
