"""Structured outputs in one engine (SmolLM2): outputs follow their schema, regex or choice, the grammar state rebuilt
from emitted tokens continues exactly as the uninterrupted run, the bitmask kernels agree, and bad specs are refused
naming the field (engine, OpenAI bodies and gRPC messages). The cluster runs are in tests/test_structured_cluster.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec, check_spec
from engine.structured_output import apply_token_bitmask, apply_token_bitmask_torch
from router.grpc_requests import sampling_fields as grpc_sampling_fields
from router.openai_models import ChatCompletionRequest, CompletionRequest, parse
from router.openai_params import sampling_fields
from router.v1 import inference_pb2 as pb
from tests.helpers import assert_idle, make_engine, run_to_completion

# Nested objects, enums, arrays and required fields; every string, number and array bounded, so an output ends (an
# unbounded integer lets greedy SmolLM2 write digits until max_tokens: valid so far, but cut off).
SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
        "required": ["name", "age", "pets", "address"]},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"]}},
        "express": {"type": "boolean"}},
        "required": ["order_id", "status", "items", "express"]},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
        "forecast": {"type": "array", "items": {"type": "integer", "minimum": -60, "maximum": 60}, "maxItems": 3}},
        "required": ["city", "conditions", "temperature_c"]},
}
QUESTIONS = {"person": "Describe a person as JSON.", "order": "Write an online shop order as JSON.",
             "weather": "Give the weather in Paris as JSON."}


def chat_ids(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_outputs_follow_their_schema_regex_and_choice(smollm2):
    engine = make_engine(smollm2, num_blocks=512)
    specs = {name: (StructuredOutputSpec.json_schema(schema), QUESTIONS[name], 0.8) for name, schema in SCHEMAS.items()}
    specs["phone"] = (StructuredOutputSpec("regex", r"\(\d{3}\) \d{3}-\d{4}"), "Give me a phone number.", 0.8)
    specs["choice"] = (StructuredOutputSpec.choices(["positive", "negative", "neutral"]),
                       "Is 'I love this' positive or negative?", 0.0)
    for rid, (spec, question, temp) in specs.items():
        engine.add_request(rid, chat_ids(smollm2, question),
                           SamplingParams(max_tokens=120, temperature=temp, seed=11, structured=spec))
    # n = 2: the second choice forks once the prompt is computed, with a matcher of its own
    engine.add_request("weather-n", chat_ids(smollm2, QUESTIONS["weather"]), SamplingParams(
        max_tokens=120, temperature=0.8, seed=12, n=2, structured=StructuredOutputSpec.json_schema(SCHEMAS["weather"])))
    assert engine.structured.num_parked == len(specs) + 1  # parked until compiled: nothing scheduled yet
    out = run_to_completion(engine)
    for name, schema in SCHEMAS.items():
        assert out[name].finish_reason == "stop", out[name].text
        jsonschema.validate(json.loads(out[name].text), schema)
    for rid in ("weather-n", "weather-n-1"):
        assert out[rid].finish_reason == "stop", out[rid].text
        jsonschema.validate(json.loads(out[rid].text), SCHEMAS["weather"])
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out["phone"].text)
    assert out["choice"].text in ("positive", "negative", "neutral")
    assert engine.structured.num_parked == 0 and not engine.has_unfinished_requests()


def test_grammar_state_rebuilt_from_emitted_tokens_continues_identically(smollm2):
    """A request resumed elsewhere (a decode failover) with the tokens it emitted: its matcher is rebuilt from them
    and the rest of the output is token for token the uninterrupted run's (a fresh matcher would restart at '{')."""
    prompt = chat_ids(smollm2, QUESTIONS["weather"])
    params = SamplingParams(max_tokens=100, temperature=0.9, seed=5,
                            structured=StructuredOutputSpec.json_schema(SCHEMAS["weather"]))
    whole = make_engine(smollm2, num_blocks=256)
    whole.add_request("whole", prompt, params)
    want = run_to_completion(whole)["whole"]
    assert want.finish_reason == "stop" and len(want.token_ids) > 8
    cuts = (1, len(want.token_ids) // 2)
    resumed = make_engine(smollm2, num_blocks=256)
    for cut in cuts:  # NOTE: both in one batch; each samples from its own seeded stream
        resumed.add_request(f"cut{cut}", prompt, params, output_token_ids=want.token_ids[:cut])
    got = run_to_completion(resumed)
    for cut in cuts:
        assert got[f"cut{cut}"].token_ids == want.token_ids and got[f"cut{cut}"].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), SCHEMAS["weather"])


def test_a_grammar_that_does_not_build_or_emitted_tokens_it_rejects_end_the_request(smollm2):
    """What the router refuses with a 400, an engine used directly ends (abort) without stalling its other requests."""
    engine = make_engine(smollm2, num_blocks=64)
    not_json = smollm2.tokenizer.encode("Sure! Here", add_special_tokens=False)
    engine.add_request("resumed", chat_ids(smollm2, "JSON please"), SamplingParams(
        max_tokens=32, structured=StructuredOutputSpec("json_object")), output_token_ids=not_json)
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured=StructuredOutputSpec("regex", "a(b")))
    engine.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    out = run_to_completion(engine)
    assert out["resumed"].finish_reason == "abort" and out["resumed"].token_ids == not_json
    assert out["bad"].finish_reason == "abort" and out["bad"].token_ids == []
    assert out["plain"].finish_reason == "length" and len(out["plain"].token_ids) == 4
    assert_idle(engine)
    with pytest.raises(InvalidRequestError) as e:  # its shape is checked where SamplingParams are made
        SamplingParams(structured=StructuredOutputSpec("xml", "<a/>"))  # type: ignore[arg-type]
    assert e.value.field == "structured"


def test_bitmask_kernels_agree_and_mask_only_disallowed_tokens():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # NOTE: not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # a row without a grammar: left alone
    logits = torch.randn(4, vocab, generator=gen)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, bitmask)  # xgrammar's CPU kernel
    apply_token_bitmask_torch(b, bitmask)
    assert torch.equal(a, b)
    allowed = torch.tensor([[bool(int(bitmask[i, t // 32]) >> (t % 32) & 1) for t in range(vocab)] for i in range(4)])
    assert torch.equal(a[allowed], logits[allowed]) and bool((a[~allowed] == float("-inf")).all())
    assert torch.equal(a[2], logits[2])


@pytest.mark.parametrize("spec, needle", [
    (StructuredOutputSpec("json", '{"type": "objectx"}'), "objectx"),
    (StructuredOutputSpec("json", "{not json"), "not valid JSON"),
    (StructuredOutputSpec("regex", "a(b"), "parenthesis"),
    (StructuredOutputSpec("grammar", 'root ::= "a" |'), "EBNF"),
    (StructuredOutputSpec.choices([]), "non-empty"),
])
def test_a_bad_spec_is_refused_naming_the_field(spec, needle):
    with pytest.raises(InvalidRequestError, match=needle) as e:
        check_spec(spec, "guided_regex")
    assert e.value.field == "guided_regex"


def test_ignore_eos_is_refused_with_a_grammar():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(ignore_eos=True, structured=StructuredOutputSpec("json_object"))
    assert e.value.field == "ignore_eos"


BASE = {"model": "smollm2", "prompt": "hi", "max_tokens": 8}


@pytest.mark.parametrize("extra, kind, value, field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}},
     "json", '{"type": "object"}', "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json", '{"type": "integer"}', "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[ab]+", "disable_fallback": True}}, "regex", "[ab]+",
     "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]', "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"', "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
    ({"guided_json": '{"type": "object"}'}, "json", '{"type": "object"}', "guided_json"),
    ({"guided_regex": "\\d+"}, "regex", "\\d+", "guided_regex"),
    ({"guided_choice": ["a"]}, "choice", '["a"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
])
def test_openai_bodies_carry_their_structured_output(extra, kind, value, field):
    req = parse(CompletionRequest, {**BASE, **extra})
    s = sampling_fields(req, req.max_tokens)
    assert s.structured == StructuredOutputSpec(kind, value) and s.structured_field == field  # type: ignore[arg-type]
    assert sampling_fields(parse(CompletionRequest, {**BASE, "response_format": {"type": "text"}}), 8).structured \
        is None


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_openai_structured_output_of_the_wrong_shape_is_refused_naming_it(extra, field):
    with pytest.raises(InvalidRequestError) as e:
        req = parse(ChatCompletionRequest, {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                                            **extra})
        sampling_fields(req, 8)
    assert e.value.field == field


@pytest.mark.parametrize("so, kind, value, field", [
    (pb.StructuredOutput(json_schema='{"type": "object"}'), "json", '{"type": "object"}',
     "sampling.structured_output.json_schema"),
    (pb.StructuredOutput(json_object=True), "json_object", "", "sampling.structured_output.json_object"),
    (pb.StructuredOutput(regex="a+"), "regex", "a+", "sampling.structured_output.regex"),
    (pb.StructuredOutput(choice=["x", "y"]), "choice", '["x", "y"]', "sampling.structured_output.choice"),
    (pb.StructuredOutput(grammar='root ::= "a"'), "grammar", 'root ::= "a"', "sampling.structured_output.grammar"),
])
def test_grpc_structured_output(so, kind, value, field):
    s = grpc_sampling_fields(pb.SamplingParams(structured_output=so))
    assert s.structured == StructuredOutputSpec(kind, value) and s.structured_field == field
    assert grpc_sampling_fields(pb.SamplingParams()).structured is None
    with pytest.raises(InvalidRequestError) as e:
        grpc_sampling_fields(pb.SamplingParams(structured_output=pb.StructuredOutput(regex="a", grammar="b")))
    assert e.value.field == "sampling.structured_output"
