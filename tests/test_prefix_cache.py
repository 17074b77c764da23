"""Prefix caching on the real SmolLM2 weights: shared prefixes are not recomputed, and a hit never changes output.

The `Completion.cached_prompt_tokens` field is checked on the tiny model (`LLM` loads its model itself).
"""

from __future__ import annotations

import engine
from engine import LLMEngine, SamplingParams
from engine.llm_engine import RequestOutput
from tests.helpers import assert_idle, greedy, make_engine, random_prompts, run_to_completion

BS = 16
PREFIX = random_prompts(1, [200], seed=21)[0]
SUFFIX_A, SUFFIX_B = random_prompts(2, [20], seed=22)
FIRST, SECOND = PREFIX + SUFFIX_A, PREFIX + SUFFIX_B
MAX_TOKENS = 6


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    engine.add_request(request_id, prompt, params)
    return run_to_completion(engine)[request_id]


def test_shared_prefix_is_served_from_cache_and_output_is_unchanged(smollm2):
    uncached = make_engine(smollm2, num_blocks=64, enable_prefix_caching=False)
    expected = [run_one(uncached, f"u{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate((FIRST, SECOND))]
    assert [o.num_cached_tokens for o in expected] == [0, 0]
    assert uncached.stats().cached_prompt_tokens == 0

    engine = make_engine(smollm2, num_blocks=64)
    s0 = engine.stats()
    first = run_one(engine, "a", FIRST, greedy(MAX_TOKENS))
    s1 = engine.stats()
    second = run_one(engine, "b", SECOND, greedy(MAX_TOKENS))
    s2 = engine.stats()

    # 200 shared tokens = 12 full blocks (192 tokens); block 12 mixes prefix and suffix, so it misses.
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12 * BS == 192
    # prefill computes the uncached prompt tokens, then one token per decode step
    assert s1.computed_tokens - s0.computed_tokens == len(FIRST) + MAX_TOKENS - 1
    assert s2.computed_tokens - s1.computed_tokens == len(SECOND) - 192 + MAX_TOKENS - 1
    assert (s2.prompt_tokens, s2.cached_prompt_tokens) == (len(FIRST) + len(SECOND), 192)
    assert s1.num_cached_blocks >= 12

    assert first.token_ids == expected[0].token_ids
    assert second.token_ids == expected[1].token_ids
    assert_idle(engine)


def test_repeated_prompt_recomputes_only_its_tail(smollm2):
    engine = make_engine(smollm2, num_blocks=64)
    first = run_one(engine, "a", FIRST, greedy(MAX_TOKENS))
    before = engine.stats()
    again = run_one(engine, "b", FIRST, greedy(MAX_TOKENS))
    after = engine.stats()
    # 220 tokens: 13 full blocks cached; the last 12 tokens (at least one is always recomputed) run again
    cached = (len(FIRST) - 1) // BS * BS
    assert again.num_cached_tokens == cached == 208
    assert after.computed_tokens - before.computed_tokens == len(FIRST) - cached + MAX_TOKENS - 1
    assert again.token_ids == first.token_ids
    assert_idle(engine)


def test_completion_reports_cached_prompt_tokens():
    llm = engine.LLM("tiny", num_blocks=64, num_threads=2)
    [first] = llm.generate([FIRST], greedy(MAX_TOKENS))
    [second] = llm.generate([SECOND], greedy(MAX_TOKENS))
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 192)
    assert second.prompt_token_ids == SECOND
    assert_idle(llm.engine)
