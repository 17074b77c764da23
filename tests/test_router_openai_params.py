"""The HTTP front parses OpenAI bodies without protobuf: the same ranges, precision and refusals as the gRPC API."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError
from router.openai_params import chat_messages, sampling
from router.v1 import inference_pb2 as pb
from router.validate import ChatTurn, SamplingFields


def proto_refusal(field: str, value: object) -> str:
    """What the proto says when a field cannot hold `value`."""
    s = pb.SamplingParams()
    with pytest.raises((TypeError, ValueError)) as e:
        if isinstance(value, list):
            getattr(s, field).extend(value)
        else:
            setattr(s, field, value)
    return str(e.value)


@pytest.mark.parametrize("param, field, value", [
    ("max_tokens", "max_tokens", -1),
    ("max_tokens", "max_tokens", 1 << 32),
    ("seed", "seed", -5),
    ("seed", "seed", 1 << 64),
    ("top_k", "top_k", -2),
    ("stop_token_ids", "stop_token_ids", [3, -1]),
    ("stop_token_ids", "stop_token_ids", [1 << 33]),
])
def test_out_of_range_values_are_refused_as_the_proto_would(param, field, value):
    body = {} if param == "max_tokens" else {param: value}
    with pytest.raises(InvalidRequestError) as e:
        sampling(body, value if param == "max_tokens" else None)
    assert e.value.field == param
    assert str(e.value) == f"{param}: out of range or of the wrong type ({proto_refusal(field, value)})"


def test_values_are_carried_as_the_proto_carries_them():
    body = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": (1 << 64) - 1, "stop": "END",
            "stop_token_ids": [2], "ignore_eos": True}
    got = sampling(body, 5)
    want = pb.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=0, seed=(1 << 64) - 1, stop=["END"],
                             stop_token_ids=[2], ignore_eos=True)
    assert got == SamplingFields(want.max_tokens, want.temperature, want.top_p, want.top_k, want.seed,
                                 list(want.stop), list(want.stop_token_ids), want.ignore_eos)
    assert got.temperature != 0.7  # NOTE: rounded to 32 bits, so HTTP and gRPC sample the very same tokens
    assert body == {}  # every key taken
    assert sampling({}, None) == SamplingFields()  # nothing set: the validator's defaults apply


def test_text_that_is_not_utf8_is_refused_naming_the_parameter():
    with pytest.raises(InvalidRequestError) as e:
        sampling({"stop": ["ok", "\ud800"]}, None)
    assert e.value.field == "stop"
    with pytest.raises(InvalidRequestError) as e:
        chat_messages([{"role": "user", "content": "a \udc00 b"}])
    assert e.value.field == "messages[0].content"


def test_chat_messages_join_text_parts():
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    assert chat_messages([{"role": "user", "content": parts}]) == [ChatTurn("user", "Name a\ncolour.")]
