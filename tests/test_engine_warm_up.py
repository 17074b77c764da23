"""A worker's engine runs one throwaway request before it serves (`LLMEngine.warm_up`): it must leave no trace."""

from __future__ import annotations

from tests.helpers import assert_idle, generate_ids, greedy, make_engine, random_prompts


def test_warm_up_computes_a_request_and_leaves_no_trace(tiny):
    prompts = random_prompts(3, [40, 17, 65], vocab=1000, seed=11)
    want = generate_ids(make_engine(tiny), prompts, greedy(6))
    engine = make_engine(tiny)
    before = engine.stats()
    steps: list[int] = []  # the tokens of every step the runner computed (a spy on the real runner)
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, *a, **k: steps.append(batch.num_tokens) or execute(batch, *a, **k)  # type: ignore
    engine.warm_up()
    engine.runner.execute = execute  # type: ignore[method-assign]
    assert steps == [engine.config.block_size // 2, 1]  # it computed: the prompt, then one decode step
    after = engine.stats()
    assert_idle(engine)
    # nothing counted (metrics and the router's step-cost fit see no request) and nothing cached (< one block)
    assert (after.prompt_tokens, after.cached_prompt_tokens, after.computed_tokens) == (0, 0, 0)
    assert after.num_cached_blocks == before.num_cached_blocks == 0
    assert generate_ids(engine, prompts, greedy(6)) == want  # the same tokens as an engine that never warmed up
    # the warm-up's id is free again: a second warm-up (or a user request of that id) is accepted
    engine.warm_up()
    assert_idle(engine)
