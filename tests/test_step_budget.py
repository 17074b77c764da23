"""The ITL budget of a step (prompt chunks beside a decode batch) and the TTFT bound of shortest_first (tiny model).

Every run is checked against one engine running the request alone: how prompts are cut into chunks must never change
tokens or text.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.step_budget import STARVED_STEPS_MAX, StepBudget
from tests.helpers import assert_idle, greedy, make_engine, random_prompts, run_to_completion

DECODERS = random_prompts(4, [12, 20, 9, 30], seed=7)
DOCUMENT = random_prompts(1, [150], seed=8)[0]


def alone(tiny, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Tokens and text of the request run alone on a fresh engine (no step target)."""
    engine = make_engine(tiny)
    engine.add_request("alone", prompt, params)
    out = run_to_completion(engine)["alone"]
    return out.token_ids, out.text


@pytest.mark.parametrize("base_ms,token_ms,decode,expected", [
    (20, 1, 0, None),  # no decode tokens in the step: nobody's gap to protect, no cap
    (20, 1, 4, 76),  # (100 - 20) / 1 - 4
    (20, 1, 60, 20),  # a bigger batch leaves less
    (20, 1, 80, 0),  # decode alone fills the step
    (20, 1, 120, 0),  # ... or overfills it: never negative
    (60, 1, 4, 36),  # slower steps (measured base) shrink it
    (20, 0.5, 4, 156),  # faster tokens grow it
])
def test_the_budget_follows_the_measured_step_cost(base_ms, token_ms, decode, expected):
    budget = StepBudget(step_target_s=0.1)
    budget.set_cost(base_ms / 1e3, token_ms / 1e3)
    assert budget.prompt_tokens(decode) == expected
    assert StepBudget(step_target_s=None).prompt_tokens(decode) is None  # off: max_num_batched_tokens only


def test_a_prompt_prefilled_in_chunks_beside_a_decode_batch_gives_the_tokens_and_text_of_one_engine(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=256, step_target_ms=100)
    engine.scheduler.budget.set_cost(0.02, 0.002)  # 40 tokens a step within 100 ms, decode tokens included
    for i, p in enumerate(DECODERS):
        engine.add_request(f"d{i}", p, greedy(40))
    engine.step()  # their prompts: no decode tokens yet, no cap
    doc = engine.add_request("doc", DOCUMENT, greedy(12))
    chunks, first_token_with_chunk, final = [], [], {}
    while engine.has_unfinished_requests():
        before, prefilling = doc.num_computed_tokens, doc.num_output_tokens == 0
        outs = engine.step()
        if prefilling:
            chunks.append(doc.num_computed_tokens - before)
            assert engine.scheduler.prompt_cap == 40 - 4  # 4 decode tokens in each of these steps
            first_token_with_chunk.append(any(o.request_id == "doc" for o in outs))
        final.update({o.request_id: o for o in outs if o.finished})
    assert chunks == [36] * 4 + [6]  # 150 tokens over five steps, each within the budget
    assert first_token_with_chunk == [False] * 4 + [True]  # its first token comes with its last chunk
    for i, p in enumerate(DECODERS):
        assert (final[f"d{i}"].token_ids, final[f"d{i}"].text) == alone(tiny, p, greedy(40))
    assert (final["doc"].token_ids, final["doc"].text) == alone(tiny, DOCUMENT, greedy(12))
    assert_idle(engine)


def test_a_decode_batch_that_fills_the_step_holds_prompts_back_but_never_forever(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=256, step_target_ms=100)
    engine.scheduler.budget.set_cost(0.09, 0.004)  # 2.5 tokens of room: the 4 decoders fill every step
    for i, p in enumerate(DECODERS):
        engine.add_request(f"d{i}", p, greedy(STARVED_STEPS_MAX + 10))
    engine.step()
    doc = engine.add_request("doc", DOCUMENT, greedy(4))
    for _ in range(STARVED_STEPS_MAX - 1):
        engine.step()
        assert engine.scheduler.prompt_cap == 0 and doc.num_computed_tokens == 0
    engine.step()  # starved that long: a block a step from now on
    assert doc.num_computed_tokens == engine.config.block_size
    engine.step()
    assert doc.num_computed_tokens == 2 * engine.config.block_size
    final = run_to_completion(engine)  # once the decoders finish, the document gets whole steps
    assert (final["doc"].token_ids, final["doc"].text) == alone(tiny, DOCUMENT, greedy(4))
    assert_idle(engine)


def test_a_document_overdue_for_its_ttft_target_goes_before_short_prompts(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=32, prefill_order="shortest_first", ttft_target_ms=2000)
    engine.scheduler.budget.set_cost(0.01, 0.001)  # the document's own compute: 5 steps + 150 ms
    now = [100.0]
    engine.scheduler.clock = lambda: now[0]
    doc = engine.add_request("doc", DOCUMENT, greedy(4))
    doc.arrival_time = now[0]
    shorts = random_prompts(3, [20, 24, 28], seed=9)

    def step_with_a_new_short(i: int) -> list[str]:
        s = engine.add_request(f"s{i}", shorts[i], greedy(2))
        s.arrival_time = now[0]
        batch = engine.scheduler.schedule
        picked: list[str] = []

        def recording():
            b = batch()
            picked.extend(x.request_id for x in b.seqs if x.num_output_tokens == 0)
            return b
        engine.scheduler.schedule = recording  # type: ignore[method-assign]
        engine.step()
        engine.scheduler.schedule = batch  # type: ignore[method-assign]
        return picked

    assert step_with_a_new_short(0)[0] == "s0"  # young: the short prompt first
    now[0] += 1.4  # 1.4 s waited + 0.19 s of its own compute (138 tokens) ≥ 0.75 × 2 s: overdue
    assert step_with_a_new_short(1)[0] == "doc"
    final = run_to_completion(engine)
    assert (final["doc"].token_ids, final["doc"].text) == alone(tiny, DOCUMENT, greedy(4))
    assert_idle(engine)
