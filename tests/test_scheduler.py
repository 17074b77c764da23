"""Continuous batching, chunked prefill, preemption and max_num_seqs, observed through the engine (tiny model).

The reference for every batched run is each request run alone on a fresh engine: batching must not change tokens.
"""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.sequence import Sequence, SequenceStatus
from tests.helpers import assert_idle, greedy, make_engine, random_prompts, run_alone, run_to_completion

PROMPTS = random_prompts(16, [5, 17, 40, 90, 150])
MAX_TOKENS = [8 + (7 * i) % 33 for i in range(16)]  # 16 distinct values in 8..40
IDS = [f"r{i}" for i in range(16)]


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    """Greedy tokens of each request, run alone on a fresh engine."""
    return [run_alone(tiny, p, greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS)]


def record_batches(engine: LLMEngine) -> list[list[str]]:
    """From now on, append the request ids of every scheduled batch to the returned list."""
    batches: list[list[str]] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append([s.request_id for s in batch.seqs])
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return batches


def submit(engine: LLMEngine, indices: range, params: list[SamplingParams] | None = None) -> list[Sequence]:
    return [engine.add_request(IDS[i], PROMPTS[i], params[i] if params else greedy(MAX_TOKENS[i])) for i in indices]


def tokens_of(final: dict) -> list[list[int]]:
    return [final[r].token_ids for r in IDS]


def test_batch_of_16_gives_the_tokens_of_16_separate_runs(tiny, reference):
    engine = make_engine(tiny)
    batches = record_batches(engine)
    submit(engine, range(16))
    finished_at: dict[str, int] = {}
    final = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
                final[out.request_id] = out
    assert tokens_of(final) == reference
    # All 16 prompts (911 tokens) fit the first step's budget; then they decode together, one token a step,
    # and each leaves the batch exactly when its own max_tokens is reached while the others keep running.
    assert sorted(batches[0]) == sorted(IDS)
    assert [finished_at[r] for r in IDS] == MAX_TOKENS
    first_done = min(MAX_TOKENS)
    assert len(batches[first_done]) == 16 - 1  # the next step ran without it, with everyone else
    assert max(len(b) for b in batches) == 16
    assert_idle(engine)


def test_requests_join_a_running_batch(tiny, reference):
    engine = make_engine(tiny)
    batches = record_batches(engine)
    submit(engine, range(8))
    final = {}
    for _ in range(5):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    submit(engine, range(8, 16))
    final.update(run_to_completion(engine))
    assert tokens_of(final) == reference
    # step 6 decodes the first eight and prefills the new eight in one batch
    assert sorted(batches[5]) == sorted(IDS)
    assert_idle(engine)


def test_chunked_prefill_gives_the_same_tokens(tiny, reference):
    engine = make_engine(tiny, max_num_batched_tokens=16)
    batches = record_batches(engine)
    submit(engine, range(16))
    computed = []
    final = {}
    while engine.has_unfinished_requests():
        before = engine.stats().computed_tokens
        final.update({o.request_id: o for o in engine.step() if o.finished})
        computed.append(engine.stats().computed_tokens - before)
    assert tokens_of(final) == reference
    assert max(computed) == 16  # the budget is used, never exceeded
    # the 150-token prompt of r4 was computed in chunks over at least 150 / 16 steps
    assert sum("r4" in b for b in batches) >= 10 + MAX_TOKENS[4] - 1
    assert_idle(engine)


def test_preemption_under_a_tiny_pool_keeps_tokens_and_frees_every_block(tiny, reference):
    longest = max(len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS))
    num_blocks = -(-longest // 16)  # just enough for the longest sequence on its own
    engine = make_engine(tiny, num_blocks=num_blocks)
    submit(engine, range(16))
    final = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    assert tokens_of(final) == reference
    assert_idle(engine)


def test_preempted_seeded_requests_sample_the_same_tokens(tiny):
    params = [SamplingParams(max_tokens=m, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    big = make_engine(tiny)
    submit(big, range(16), params)
    expected = tokens_of(run_to_completion(big))

    small = make_engine(tiny, num_blocks=12)
    submit(small, range(16), params)
    final = run_to_completion(small)
    assert small.stats().num_preemptions > 0
    assert tokens_of(final) == expected
    assert_idle(small)


def test_max_num_seqs_caps_the_running_batch(tiny, reference):
    engine = make_engine(tiny, max_num_seqs=3)
    batches = record_batches(engine)
    submit(engine, range(16))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(engine.scheduler.running) <= 3
    assert tokens_of(final) == reference
    assert max(len(b) for b in batches) == 3
    assert_idle(engine)


def test_aborted_requests_free_their_blocks_and_leave_the_others_unchanged(tiny, reference):
    engine = make_engine(tiny, max_num_seqs=8)  # half run, half wait: abort hits both kinds
    seqs = submit(engine, range(16))
    final = {}
    for _ in range(4):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    aborted = seqs[1::2]
    assert {s.status for s in aborted} == {SequenceStatus.RUNNING, SequenceStatus.WAITING}
    for s in aborted:
        engine.abort_request(s.request_id)
    assert all(s.finish_reason == "abort" and s.block_table == [] for s in aborted)
    engine.abort_request("never-submitted")  # unknown ids are ignored
    final.update(run_to_completion(engine))
    assert sorted(final) == sorted(IDS[0::2])
    assert [final[r].token_ids for r in IDS[0::2]] == reference[0::2]
    assert_idle(engine)


SHARED_PREFIX_PROMPTS = [p[:k] + s for p, k, s in zip(
    [PROMPTS[4]] * 4 + [PROMPTS[3]] * 4, [150, 100, 37, 8, 90, 64, 63, 20], random_prompts(8, [1, 9, 30], seed=7))]


@pytest.mark.parametrize("settings", [
    {"block_size": 4, "num_blocks": 48, "max_num_batched_tokens": 3},
    {"block_size": 8, "num_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 2},
    {"block_size": 16, "num_blocks": 12, "max_num_batched_tokens": 16},
    {"block_size": 16, "num_blocks": 12, "enable_prefix_caching": False},
], ids=["bs4-budget3", "bs8-2seqs", "bs16-chunks", "no-cache"])
def test_shared_prefixes_staggered_arrivals_and_tight_pools_keep_tokens(tiny, settings):
    """Prefix hits, chunking and preemption together, with requests arriving while others run."""
    bs = settings["block_size"]
    expected = [run_alone(tiny, p, greedy(12), block_size=bs) for p in SHARED_PREFIX_PROMPTS]
    engine = make_engine(tiny, **settings)
    final = {}
    for i, p in enumerate(SHARED_PREFIX_PROMPTS):
        engine.add_request(f"s{i}", p, greedy(12))
        for _ in range(3):
            final.update({o.request_id: o for o in engine.step() if o.finished})
    final.update(run_to_completion(engine))
    assert [final[f"s{i}"].token_ids for i in range(8)] == expected
    s = engine.stats()
    assert (s.cached_prompt_tokens > 0) == settings.get("enable_prefix_caching", True)
    assert_idle(engine)


@pytest.mark.parametrize("order", ["fcfs", "shortest_first"])
def test_a_short_prompt_overtakes_a_long_one_mid_prefill_only_when_shortest_first(tiny, order):
    engine = make_engine(tiny, max_num_batched_tokens=32, prefill_order=order)
    batches = record_batches(engine)
    long_prompt, short_prompt = random_prompts(2, [150, 6])
    engine.add_request("long", long_prompt, greedy(4))
    engine.step()  # the long prompt's first 32-token chunk
    engine.add_request("short", short_prompt, greedy(4))
    final = run_to_completion(engine)
    first_step_of_short = next(i for i, b in enumerate(batches) if "short" in b)
    if order == "shortest_first":
        assert batches[1][0] == "short"  # its 6 tokens first, the long prompt's chunk gets the other 26
        assert first_step_of_short == 1
    else:
        assert batches[1] == ["long"]  # the long prompt keeps the whole budget until only 22 tokens are left
        assert first_step_of_short == 4
    # either way, the tokens are those of each request run alone
    assert final["long"].token_ids == run_alone(tiny, long_prompt, greedy(4))
    assert final["short"].token_ids == run_alone(tiny, short_prompt, greedy(4))
    assert_idle(engine)


def test_a_paused_request_is_not_stepped_gives_its_blocks_first_and_resumes_with_the_same_tokens(tiny, reference):
    """A paused request (its consumer stopped reading) is left out of every step; when the pool runs dry its blocks
    go before a running request's; resumed, it finishes with the tokens of an unpaused run."""
    longest = max(len(PROMPTS[i]) + MAX_TOKENS[i] for i in (3, 4))
    engine = make_engine(tiny, num_blocks=-(-longest // 16) + 1)  # NOTE: room for one of them, not both
    held, other = submit(engine, range(3, 5))
    while held.num_output_tokens < 2:
        engine.step()
    assert engine.pause_request(IDS[3])
    made = held.num_output_tokens
    final = run_to_completion(engine)  # the other one runs alone: it needs the paused one's blocks
    assert set(final) == {IDS[4]} and held.num_output_tokens == made
    assert held.status is SequenceStatus.WAITING and held.block_table == []  # preempted while paused
    engine.resume_request(IDS[3])
    final.update(run_to_completion(engine))
    assert [final[r].token_ids for r in IDS[3:5]] == reference[3:5]
    assert_idle(engine)
