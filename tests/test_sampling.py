"""Sampling and stopping as a user sees them: seeds, top-k/top-p, max_tokens, stop tokens, EOS and stop strings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.llm_engine import RequestOutput
from engine.loader import LoadedModel
from engine.sampler import sample
from tests.helpers import Row, assert_idle, generate_ids, greedy, make_engine, random_prompts, run_alone


def rows_of(params: list[SamplingParams]) -> list[Row]:
    return [Row(p, [0]) for p in params]


PROMPT = random_prompts(1, [24], seed=11)[0]
N = 24


def sampled(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": N, "temperature": 1.0, "seed": seed, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def greedy_tokens(tiny) -> list[int]:
    return run_alone(tiny, PROMPT, greedy(N))


def first_new_token_index(tokens: list[int], start: int = 3) -> int:
    """Index of the first token at or after `start` that does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def stream(engine: LLMEngine, request_id: str, prompt: list[int],
           params: SamplingParams) -> tuple[list[RequestOutput], RequestOutput]:
    """Every RequestOutput of one request, stepping until it finishes; (outputs, final output)."""
    engine.add_request(request_id, prompt, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == request_id)
    assert outs[-1].finished
    return outs, outs[-1]


# ---- seeds -------------------------------------------------------------------------------------------------
def test_same_seed_gives_the_same_tokens_on_two_engines(tiny, greedy_tokens):
    first, second = run_alone(tiny, PROMPT, sampled(7)), run_alone(tiny, PROMPT, sampled(7))
    assert first == second
    assert first != greedy_tokens  # it really sampled


def test_different_seeds_give_different_tokens(tiny):
    runs = [tuple(run_alone(tiny, PROMPT, sampled(seed))) for seed in (7, 8, 9)]
    assert len(set(runs)) == 3


def test_seeded_request_samples_the_same_alone_or_in_a_batch(tiny):
    alone = run_alone(tiny, PROMPT, sampled(7))
    others = random_prompts(5, [3, 40, 17, 90, 8], seed=5)
    engine = make_engine(tiny)
    prompts = others[:2] + [PROMPT] + others[2:]
    params = [sampled(seed) for seed in (1, 2, 7, 3, 4)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"b{i}", p, sp)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["b2"].token_ids == alone
    assert_idle(engine)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=1e-6"])
def test_filters_that_keep_one_token_equal_greedy(tiny, greedy_tokens, filters):
    assert run_alone(tiny, PROMPT, sampled(7, temperature=1.5, **filters)) == greedy_tokens


# ---- the sampler on hand-made logits -----------------------------------------------------------------------
LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -3.0, 0.2, 0.9, -0.5])  # top 3: ids 1, 3, 5
DRAWS = 10_000


def draw(params: list[SamplingParams]) -> torch.Tensor:
    """One token per params (each with its own seed) from LOGITS; their frequencies over the vocabulary."""
    tokens = sample(LOGITS.expand(len(params), -1).contiguous(), rows_of(params)).token_ids.tolist()
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / len(params)


def test_top_k_sampling_draws_only_the_top_k_in_softmax_proportion():
    freq = draw([SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(DRAWS)])
    top3 = [1, 3, 5]
    assert set(torch.nonzero(freq).flatten().tolist()) == set(top3)
    expected = LOGITS[top3].softmax(-1)  # [0.51, 0.31, 0.19]
    assert torch.allclose(freq[top3], expected, atol=0.02), (freq[top3], expected)


def test_top_p_sampling_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=s) for s in range(DRAWS)]
    tokens = sample(logits.expand(DRAWS, -1).contiguous(), rows_of(params)).token_ids.tolist()
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / DRAWS
    # 0.5 < 0.7, so the second token is needed; 0.5 + 0.3 >= 0.7, so the third is not
    assert freq[2] == 0 and freq[3] == 0
    assert abs(float(freq[0]) - 0.5 / 0.8) < 0.02


def test_temperature_sampling_follows_softmax_without_filters():
    freq = draw([SamplingParams(temperature=1.0, seed=s) for s in range(DRAWS)])
    assert torch.allclose(freq, LOGITS.softmax(-1), atol=0.02)


# ---- stopping ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_max_tokens_finishes_with_length_after_exactly_that_many(tiny, greedy_tokens, max_tokens):
    engine = make_engine(tiny)
    outs, final = stream(engine, "m", PROMPT, greedy(max_tokens))
    assert final.finish_reason == "length"
    assert final.token_ids == greedy_tokens[:max_tokens]
    assert len(outs) == max_tokens and [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert_idle(engine)


def test_stop_token_id_finishes_with_stop_and_is_the_last_token(tiny, greedy_tokens):
    k = first_new_token_index(greedy_tokens)
    engine = make_engine(tiny)
    _, final = stream(engine, "s", PROMPT, dataclasses.replace(greedy(N), stop_token_ids=[greedy_tokens[k]]))
    assert final.finish_reason == "stop"
    assert final.token_ids == greedy_tokens[: k + 1]
    assert_idle(engine)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_generation_unless_ignore_eos(tiny, greedy_tokens, ignore_eos):
    k = first_new_token_index(greedy_tokens)
    # NOTE: the tiny model rarely samples its real EOS; the same weights with another EOS id stop on demand.
    with_eos = LoadedModel(dataclasses.replace(tiny.config, eos_token_ids=(greedy_tokens[k],)), tiny.weights,
                           tiny.tokenizer)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=ignore_eos)
    tokens = generate_ids(make_engine(with_eos), [PROMPT], params)[0]
    assert tokens == (greedy_tokens if ignore_eos else greedy_tokens[: k + 1])


def token_ends(engine: LLMEngine, prompt: list[int], n: int) -> tuple[str, list[int]]:
    """Greedy text of n tokens and, per token, the length of the text once that token is in."""
    outs, final = stream(engine, "full", prompt, greedy(n))
    ends, total = [], 0
    for o in outs:
        total += len(o.new_text)
        ends.append(total)
    assert "".join(o.new_text for o in outs) == final.text
    return final.text, ends


@pytest.mark.parametrize("extra_stops", [[], ["\x00never appears"]], ids=["one", "two"])
def test_stop_string_cuts_the_text_before_it_and_never_streams_it(tiny, greedy_tokens, extra_stops):
    engine = make_engine(tiny)
    full, ends = token_ends(engine, PROMPT, N)
    # A stop string from 2 characters before token 6 into 2 characters of token 7: it spans token boundaries.
    start, end = ends[5] - 2, ends[6] + 2
    stop = full[start:end]
    assert full.find(stop) == start and end <= ends[7], (full, ends)
    completes_at = next(i for i, e in enumerate(ends) if e >= end)  # the token that completes the stop string

    outs, final = stream(engine, "cut", PROMPT, dataclasses.replace(greedy(N), stop=[*extra_stops, stop]))
    assert final.finish_reason == "stop"
    assert final.text == full[:start] and stop not in final.text
    assert final.token_ids == greedy_tokens[: completes_at + 1]
    streamed = ""
    for o in outs:
        streamed += o.new_text
        assert final.text.startswith(streamed)  # nothing streamed is ever taken back
    assert streamed == final.text
    assert_idle(engine)


def test_unmatched_stop_string_holds_back_text_but_returns_all_of_it(tiny, greedy_tokens):
    engine = make_engine(tiny)
    full, _ = token_ends(engine, PROMPT, N)
    outs, final = stream(engine, "hold", PROMPT, dataclasses.replace(greedy(N), stop=["\x00" * 10]))
    assert final.finish_reason == "length" and final.text == full
    assert "".join(o.new_text for o in outs) == full
    assert len("".join(o.new_text for o in outs[:-1])) <= len(full) - 9  # the last 9 characters waited
