"""Bad input is refused with an error naming the field, and leaves the engine exactly as it was (tiny model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

import engine
from engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from engine.loader import load_model
from engine.sampling_params import MAX_STOP_STRINGS
from tests.helpers import assert_idle, greedy, make_engine, random_prompts, run_alone, run_to_completion

MAX_MODEL_LEN = 64
GOOD = random_prompts(1, [12], seed=41)[0]
VOCAB = 49152  # the tiny model shares SmolLM2's vocabulary


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return run_alone(tiny, GOOD, greedy(6))


@pytest.fixture
def eng(tiny) -> LLMEngine:
    e = make_engine(tiny, num_blocks=32, max_model_len=MAX_MODEL_LEN)
    assert e.model_config.vocab_size == VOCAB
    return e


def serves_good_request(e: LLMEngine, expected: list[int], request_id: str = "r") -> None:
    """The engine still answers correctly (the failed id is free again), and ends with every block free."""
    e.add_request(request_id, GOOD, greedy(6))
    assert run_to_completion(e)[request_id].token_ids == expected
    assert_idle(e)


# ---- sampling parameters --------------------------------------------------------------------------------------
BAD_PARAMS = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", 1000.0),
    ("top_k", -2), ("top_k", 2.0),
    ("seed", -1), ("seed", 2**64),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", [""]), ("stop", ["x" * 1000]),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_PARAMS])
def test_bad_sampling_parameter_is_refused_naming_the_field(eng, expected, field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and field in str(err.value)

    # the same value slipped in after construction is caught by add_request, before anything is queued
    params = greedy(6)
    setattr(params, field, value)
    before = eng.stats()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request("r", GOOD, params)
    assert err.value.field == field and field in str(err.value)
    assert eng.stats() == before
    serves_good_request(eng, expected)


# ---- requests ---------------------------------------------------------------------------------------------------
def _duplicate_id(e: LLMEngine) -> Callable[[], object]:
    e.add_request("r", GOOD, greedy(2))
    return lambda: e.add_request("r", GOOD, greedy(2))


BAD_REQUESTS: dict[str, tuple[str, Callable[[LLMEngine], Callable[[], object]]]] = {
    "empty_text": ("prompt", lambda e: lambda: e.add_request("r", "", greedy(4))),
    "empty_ids": ("prompt_token_ids", lambda e: lambda: e.add_request("r", [], greedy(4))),
    "not_a_prompt": ("prompt", lambda e: lambda: e.add_request("r", 42, greedy(4))),  # type: ignore[arg-type]
    "text_too_long": ("prompt", lambda e: lambda: e.add_request("r", "hello " * 100, greedy(4))),
    "ids_too_long": ("prompt_token_ids", lambda e: lambda: e.add_request("r", [200] * MAX_MODEL_LEN, greedy(4))),
    "id_past_vocab": ("prompt_token_ids", lambda e: lambda: e.add_request("r", [1, VOCAB], greedy(4))),
    "negative_id": ("prompt_token_ids", lambda e: lambda: e.add_request("r", [1, -1], greedy(4))),
    "float_id": ("prompt_token_ids", lambda e: lambda: e.add_request("r", [1, 2.0], greedy(4))),  # type: ignore[list-item]
    "stop_token_past_vocab": ("stop_token_ids", lambda e: lambda: e.add_request(
        "r", GOOD, dataclasses.replace(greedy(4), stop_token_ids=[VOCAB]))),
    "empty_request_id": ("request_id", lambda e: lambda: e.add_request("", GOOD, greedy(4))),
    "duplicate_request_id": ("request_id", _duplicate_id),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_engine_still_serves(eng, expected, case):
    field, setup = BAD_REQUESTS[case]
    bad = setup(eng)
    before = eng.stats()
    with pytest.raises(InvalidRequestError) as err:
        bad()
    assert err.value.field == field and field in str(err.value)
    assert eng.stats() == before
    run_to_completion(eng)  # (the duplicate case has its first request to finish)
    serves_good_request(eng, expected)


def test_prompt_one_short_of_max_model_len_generates_one_token(eng):
    eng.add_request("edge", [200] * (MAX_MODEL_LEN - 1), greedy(10))
    out = run_to_completion(eng)["edge"]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert_idle(eng)


# ---- engine settings and models -------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("block_size", 0), ("num_blocks", 0), ("max_num_seqs", 0),
                                              ("max_num_batched_tokens", -1), ("max_model_len", 0),
                                              ("kv_cache_memory_gb", 0.0), ("dtype", "int3")])
def test_bad_engine_setting_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(**{field: value})
    assert err.value.field == field and field in str(err.value)


@pytest.mark.parametrize("load", [load_model, engine.LLM], ids=["load_model", "LLM"])
@pytest.mark.parametrize("path", ["/nope", "dir_without_config"])
def test_unknown_model_path_is_refused_naming_the_model(load, path, tmp_path):
    where = str(tmp_path) if path == "dir_without_config" else path
    with pytest.raises(ModelLoadError) as err:
        load(where)
    assert isinstance(err.value, ValueError)
    assert err.value.field == "model" and where in str(err.value)


# ---- LLM.generate -----------------------------------------------------------------------------------------------
def test_generate_with_one_bad_prompt_raises_and_leaves_the_engine_empty(expected):
    llm = engine.LLM("tiny", num_blocks=32, num_threads=2)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([GOOD, random_prompts(1, [30])[0], [1, VOCAB], GOOD], greedy(6))
    assert err.value.field == "prompt_token_ids"
    assert_idle(llm.engine)
    assert [c.token_ids for c in llm.generate([GOOD, GOOD], greedy(6))] == [expected, expected]
    assert_idle(llm.engine)


def test_generate_with_a_wrong_number_of_sampling_params_raises(expected):
    llm = engine.LLM("tiny", num_blocks=32, num_threads=2)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([GOOD, GOOD], [greedy(6)])
    assert err.value.field == "sampling_params"
    assert_idle(llm.engine)
