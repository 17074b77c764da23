"""Speculative decoding in the engine: n-gram drafts, verification, rollback, stops, and the sampled distribution.

Random tiny models rarely repeat themselves, so most tests hand the engine an oracle proposer that drafts the
reference continuation with every third draft token corrupted: each step then accepts some drafts and rejects
others, which exercises verification and the KV rollback on every step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, SamplingParams
from engine.config import SpeculativeConfig
from engine.sampler import filtered_probs
from engine.spec_decode import NgramProposer, verify
from tests.helpers import assert_idle, generate_ids, greedy, make_engine, random_prompts, run_to_completion

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = random_prompts(3, [20, 37, 50], vocab=1000, seed=3)


class Oracle:
    """Drafts the known continuation of each prompt, corrupting every third draft token."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, token_ids: list[int], max_draft: int) -> list[int]:
        for prompt, cont in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = cont[done : done + min(4, max_draft)]
                return [t if (done + i) % 3 else (t + 1) % 1000 for i, t in enumerate(draft)]
        return []


def oracle_engine(tiny, continuations: list[list[int]], prompts=PROMPTS, **overrides: object):
    e = make_engine(tiny, speculative_config=SPEC, **overrides)
    e.proposer = Oracle({tuple(p): c for p, c in zip(prompts, continuations)})  # type: ignore[assignment]
    return e


@pytest.mark.parametrize("tokens, n_max, n_min, k, want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, 1, 4, [9, 1, 2, 3]),  # the 3-gram [1, 2, 3] matched: what followed it
    ([1, 2, 3, 9, 5, 1, 2, 3], 3, 1, 2, [9, 5]),  # capped at k
    ([7, 1, 2, 8, 4, 2], 3, 1, 4, [8, 4, 2]),  # only the 1-gram [2] matches
    ([7, 1, 2, 8, 4, 2], 3, 2, 4, []),  # ... which is below prompt_lookup_min
    ([5, 6, 5, 7, 5], 1, 1, 1, [7]),  # the latest earlier occurrence wins
    ([4], 2, 1, 3, []),
])
def test_ngram_proposer_drafts_what_followed_the_latest_match(tokens, n_max, n_min, k, want):
    p = NgramProposer(SpeculativeConfig("ngram", k, n_max, n_min))
    assert p.propose(tokens, max_draft=10) == want
    assert p.propose(tokens, max_draft=1) == want[:1]


def test_greedy_output_is_token_identical_and_kv_is_rolled_back(tiny):
    want = generate_ids(make_engine(tiny), PROMPTS, greedy(24))
    e = oracle_engine(tiny, want)
    assert generate_ids(e, PROMPTS, greedy(24)) == want
    s = e.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # drafts were both accepted and rejected
    # fewer forward positions than plain decoding (prompts + 23 decode steps each; the first token comes from prefill)
    assert s.computed_tokens - s.spec_draft_tokens < sum(len(p) for p in PROMPTS) + 3 * 23
    assert_idle(e)  # every block of rejected drafts went back to the pool
    # the prefix cache holds the same blocks as without speculation: rolled-back slots were never registered
    again = generate_ids(e, PROMPTS, greedy(24), prefix="again")
    assert again == want and e.stats().cached_prompt_tokens > 0


def test_the_ngram_proposer_in_the_engine_keeps_the_output(tiny):
    """(A random model's output rarely repeats its context: tests/test_spec_cluster.py checks real acceptance.)"""
    prompt = PROMPTS[0] * 4
    want = generate_ids(make_engine(tiny), [prompt], greedy(16))
    e = make_engine(tiny, speculative_config=SPEC)
    assert generate_ids(e, [prompt], greedy(16)) == want
    assert_idle(e)


@pytest.mark.parametrize("cut", ["stop_token", "stop_string", "max_tokens"])
def test_stops_cut_exactly_where_plain_decoding_does(tiny, cut):
    ref = make_engine(tiny)
    ref.add_request("r", PROMPTS[1], greedy(30))
    full = run_to_completion(ref)["r"]
    base = greedy(30)
    if cut == "stop_token":
        params = dataclasses.replace(base, stop_token_ids=[full.token_ids[9]])
    elif cut == "stop_string":
        params = dataclasses.replace(base, stop=[full.text[len(full.text) // 2 : len(full.text) // 2 + 3]])
    else:
        params = dataclasses.replace(base, max_tokens=7)
    plain, spec = make_engine(tiny), oracle_engine(tiny, [[], full.token_ids], [PROMPTS[0], PROMPTS[1]])
    outs = {}
    for name, e in (("plain", plain), ("spec", spec)):
        e.add_request("r", PROMPTS[1], dataclasses.replace(params))
        streamed = []
        final = None
        while e.has_unfinished_requests():
            for o in e.step():
                streamed.append(o.new_text)
                final = o
        outs[name] = (final.token_ids, final.text, final.finish_reason, "".join(streamed))
        assert_idle(e)
    assert outs["spec"] == outs["plain"]
    assert len(outs["plain"][0]) < 30


def test_a_request_resumed_mid_way_continues_like_plain_decoding(tiny):
    """A decode failover: the new engine gets the tokens so far (and the characters already sent)."""
    ref = make_engine(tiny)
    ref.add_request("r", PROMPTS[2], greedy(20))
    full = run_to_completion(ref)["r"]
    e = oracle_engine(tiny, [[], [], full.token_ids])
    e.add_request("r", PROMPTS[2], greedy(20), output_token_ids=full.token_ids[:6], sent_chars=3)
    out = run_to_completion(e)["r"]
    assert out.token_ids == full.token_ids and out.text == full.text
    assert e.stats().spec_accepted_tokens > 0


def test_rejection_sampling_keeps_the_plain_samplers_distribution():
    """First token ~ p0; given it equals the draft, the next ~ p1 (the standard rejection rule, one-hot draft)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, -0.5]])
    draft = [1]  # not the most likely token: rejections happen
    n = 6000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    outs = [verify(logits, draft, p, 0) for p in params]
    p0, p1 = filtered_probs(logits[0], params[0]), filtered_probs(logits[1], params[0])
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=5).float() / n
    accepted = [o[1] for o in outs if o[0] == draft[0]]
    second = torch.bincount(torch.tensor(accepted), minlength=5).float() / len(accepted)
    assert all(len(o) == (2 if o[0] == draft[0] else 1) for o in outs)
    assert (first - p0).abs().max() < 0.02, (first, p0)
    assert (second - p1).abs().max() < 0.04, (second, p1)


def test_sampled_generation_is_reproducible_and_stays_in_the_top_k(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=3, seed=7, ignore_eos=True)
    want = generate_ids(make_engine(tiny), [PROMPTS[0]], greedy(16))
    runs = [generate_ids(oracle_engine(tiny, want), [PROMPTS[0]], params) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0][0]) == 16


@pytest.mark.parametrize("spec, field", [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"draft_model": "x"}, "speculative_config"),
])
def test_bad_speculative_config_names_the_key(spec, field):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(speculative_config=spec)  # type: ignore[arg-type]
    assert e.value.field == field
