"""The sampler's fast paths: top-p over the top candidates equals the rule over the whole sorted vocabulary, and
the exponential race with E = -log(U) draws each token in proportion to its probability, reproducibly per seed."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import TOP_P_CANDIDATES, _filter_top_k_top_p, race


def _full_sort_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule as the whole sorted vocabulary states it (the implementation before the candidates)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat (the cut beyond the candidates) to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_over_candidates_equals_the_full_sort(spread: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        logits = torch.randn(49152, generator=gen) * spread
        got, want = _filter_top_k_top_p(logits, 0, top_p), _full_sort_top_p(logits, top_p)
        differ = (got.isfinite() != want.isfinite()).nonzero().flatten().tolist()
        # NOTE: the candidates' probabilities are normalized over the unsorted vocabulary (a sum in another order):
        # at most the one token whose preceding mass is top_p to float precision may land on the other side.
        assert len(differ) <= 1
        for tok in differ:
            probs = logits.softmax(-1)
            assert abs(float(probs[probs > probs[tok]].sum()) - top_p) < 1e-5
        kept = int(got.isfinite().sum())
        assert kept >= 1
        if spread == 0.5 and top_p >= 0.5:
            assert kept > TOP_P_CANDIDATES[-1]  # this case takes the full-sort fallback
        if spread == 3.0 and top_p == 0.9:
            assert TOP_P_CANDIDATES[0] < kept < TOP_P_CANDIDATES[-1]  # the second round of candidates
        if spread == 12.0:
            assert kept < TOP_P_CANDIDATES[0]


def test_top_p_after_top_k_and_on_a_small_vocabulary() -> None:
    logits = torch.tensor([3.0, 1.0, 2.0, 0.5, -1.0])
    assert _filter_top_k_top_p(logits, 0, 0.7).isfinite().tolist() == [True, False, True, False, False]
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(1000, generator=gen)
    got = _filter_top_k_top_p(big, 40, 0.95)
    assert torch.equal(got.isfinite(), _full_sort_top_p(big.masked_fill(big < big.topk(40).values[-1],
                                                                       float("-inf")), 0.95).isfinite())


def test_race_draws_in_proportion_and_is_reproducible() -> None:
    probs = torch.zeros(1000)
    probs[[3, 500, 999]] = torch.tensor([0.5, 0.3, 0.2])
    counts = {3: 0, 500: 0, 999: 0}
    n = 6000
    for i in range(n):
        tok = int(race(probs, torch.Generator().manual_seed(i)))  # a 0-d tensor: no read-back in the sampler
        counts[tok] += 1  # a zero-probability token is never drawn (KeyError otherwise)
    for tok, p in ((3, 0.5), (500, 0.3), (999, 0.2)):
        assert abs(counts[tok] / n - p) < 0.03
    assert race(probs, torch.Generator().manual_seed(5)) == race(probs, torch.Generator().manual_seed(5))
