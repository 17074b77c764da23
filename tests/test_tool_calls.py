"""Tool calling without a cluster: the parsers on text (whole and in every split), the checks of tools / tool_choice
(each bad input names its field), the shipped Hermes template for SmolLM2, the validator's plan and grammar, the
chunk wrapper's finish reason, and the `router.chat_template` / `router.tool_call_parser` options.

Through a cluster (the openai client, gRPC, the prefill -> decode handoff): tests/test_tool_calls_cluster.py.
"""

from __future__ import annotations

import asyncio
import json

import gguf
import pytest

from engine.errors import InvalidRequestError
from engine.loader import smollm2_path
from engine.tokenizer import Tokenizer
from pdcluster.config import ClusterConfig, ConfigError
from router.chat_template import ChatOptions, load_chat_template
from router.openai_models import ChatCompletionRequest, parse
from router.openai_params import chat_turns, sampling_fields, tool_request
from router.results import Chunk
from router.tool_calls import ToolCall, ToolFunction, ToolPlan, ToolRequest, plan_tools
from router.tool_parsers import HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolParser
from router.tool_stream import merge_calls, tool_chunks
from router.validate import MessagesRequest, RequestValidator

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def parse_all(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """`text` fed `step` characters at a time: the content and the whole calls (name, arguments)."""
    content, calls = "", list[ToolCall]()
    for i in range(0, len(text), step):
        c, pieces = parser.feed(text[i:i + step])
        content += c
        merge_calls(calls, pieces)
    c, pieces = parser.finish()
    merge_calls(calls, pieces)
    return content + c, [(call.name, call.arguments) for call in calls]


HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
              '\n</tool_call>\n<tool_call>\n{"arguments": {"x": "a \\" quote"}, "name": "f2"}\n</tool_call>')
PARSED = [
    (HermesParser, HERMES_TWO, "Let me look.\n",
     [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("f2", '{"x": "a \\" quote"}')]),
    (HermesParser, "It is sunny. a < b <tool_ca", "It is sunny. a < b <tool_ca", []),  # a held tag prefix comes back
    (HermesParser, "<tool_call>{not json}</tool_call> then", "<tool_call>{not json}</tool_call> then", []),
    (HermesParser, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    (HermesParser, '<tool_call>{"name": "f"}</tool_call>\nDone.', "Done.", [("f", "{}")]),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>', "",
     [("f", '{"a": 1}')]),  # a repeated key: the first value counts
    (HermesParser, '<tool_call>{"name": "f"}</tool_call> x <', "x <", [("f", "{}")]),
    (HermesParser, '<tool_call>{"name": "f"}</tool_', "", [("f", "{}")]),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (Llama3JsonParser, ' {"name": "f", "parameters": {"a": true, "b": null}, "x": 12}', "",
     [("f", '{"a": true, "b": null}')]),
    (Llama3JsonParser, 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    (Llama3JsonParser, '{"nome": 1} rest', '{"nome": 1} rest', []),
    (RequiredParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"q": "]}"}}]', "",
     [("f", '{"a": 1}'), ("g", '{"q": "]}"}')]),
]


@pytest.mark.parametrize("kind, text, content, calls", PARSED)
def test_parsers_read_the_same_calls_and_content_whatever_the_deltas(kind, text, content, calls):
    for step in (1, 2, 3, 7, len(text)):
        assert parse_all(kind(), text, step) == (content, calls), step


def test_a_call_is_named_before_its_arguments_arrive_and_they_come_in_pieces():
    parser = HermesParser()
    _, first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(p.index, p.name, p.arguments) for p in first] == [(0, "get_weather", '{"ci')] and first[0].id
    _, more = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [(p.index, p.id, p.name, p.arguments) for p in more] == [(0, "", "", 'ty": "Paris"}')]
    assert parse_all(NamedParser("f"), '{"a": 1}', 2) == ("", [("f", '{"a": 1}')])


def run_chunks(plan: ToolPlan, texts: list[str], finish: str = "stop") -> list[Chunk]:
    async def collect() -> list[Chunk]:
        async def source():
            for i, t in enumerate(texts):
                yield Chunk("r", [i], t, finish if i == len(texts) - 1 else "")
        return [c async for c in tool_chunks(source(), plan)]
    return asyncio.run(collect())


def test_the_chunk_wrapper_sets_tool_calls_as_finish_reason_and_keeps_one_call_without_parallel():
    texts = ["Sure.<tool", '_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", ',
             '"arguments": {"x": 1}}</tool_call>']
    chunks = run_chunks(ToolPlan("auto", parser="hermes"), texts)
    assert "".join(c.text for c in chunks) == "Sure." and chunks[-1].finish_reason == "tool_calls"
    calls: list[ToolCall] = []
    for c in chunks:
        merge_calls(calls, c.tool_calls)
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
    one = run_chunks(ToolPlan("auto", parser="hermes", parallel=False), texts)
    assert {p.index for c in one for p in c.tool_calls} == {0}
    plain = run_chunks(ToolPlan("auto", parser="hermes"), ["No call", " here."], finish="length")
    assert "".join(c.text for c in plain) == "No call here." and plain[-1].finish_reason == "length"


def test_each_choice_of_n_gets_its_own_parser():
    async def collect() -> list[Chunk]:
        async def source():  # NOTE: two choices' chunks interleaved, as fan_out merges them
            texts = [(0, '<tool_call>{"name": "a", "argu'), (1, "plain "), (0, 'ments": {"k": 1}}</tool_call>'),
                     (1, "<tool_call>"), (1, '{"name": "b"}</tool_call>'), (0, "")]
            for i, (index, text) in enumerate(texts):
                yield Chunk("r", [i], text, "stop" if i >= 4 else "", index=index)
        return [c async for c in tool_chunks(source(), ToolPlan("auto", parser="hermes"))]
    chunks = asyncio.run(collect())
    for index, want_text, want_calls in [(0, "", [("a", '{"k": 1}')]), (1, "plain ", [("b", "{}")])]:
        mine = [c for c in chunks if c.index == index]
        calls: list[ToolCall] = []
        for c in mine:
            merge_calls(calls, c.tool_calls)
        assert "".join(c.text for c in mine) == want_text and [(c.name, c.arguments) for c in calls] == want_calls
        assert mine[-1].finish_reason == "tool_calls"


def tools_of(tools, choice="", parallel=True) -> ToolRequest:
    return ToolRequest([ToolFunction(t["function"]["name"], "", t["function"].get("parameters"),
                                     f"tools[{i}].function") for i, t in enumerate(tools)], choice,
                       "get_weather" if choice == "function" else "", parallel)


@pytest.mark.parametrize("tools, choice, parser, structured, field", [
    (TOOLS, "function", None, None, "tool_choice"),  # names get_weather; not in [get_time] below
    ([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "objekt"}}}], "required",
     None, None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "get_weather", "parameters": [1]}}], "auto", "hermes", None,
     "tools[0].function.parameters"),
    (TOOLS, "auto", "hermes", "response_format", "response_format"),
    (TOOLS, "auto", None, None, "tool_choice"),  # no router.tool_call_parser
    ([], "required", None, None, "tool_choice"),
    ([{"type": "function", "function": {"name": "get weather"}}], "required", None, None, "tools[0].function.name"),
    (TOOLS + TOOLS[:1], "required", None, None, "tools[2].function.name"),
    (TOOLS, "sometimes", "hermes", None, "tool_choice"),
])
def test_bad_tool_requests_are_refused_naming_the_field(tools, choice, parser, structured, field):
    req = tools_of(tools if field != "tool_choice" or choice != "function" else TOOLS[1:], choice)
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(req, parser, structured, "r")
    assert e.value.field == field


def test_forced_choices_become_grammars_and_none_is_plain_text():
    plan, spec = plan_tools(tools_of(TOOLS, "function"), None, None, "r")
    assert plan == ToolPlan("function", function="get_weather") and spec is not None
    assert json.loads(spec.value) == WEATHER
    plan, spec = plan_tools(tools_of(TOOLS, "required", parallel=False), None, None, "r")
    assert plan == ToolPlan("required", parallel=False) and spec is not None
    schema = json.loads(spec.value)
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    assert plan_tools(tools_of(TOOLS, "none"), None, None, "r") == (None, None)
    assert plan_tools(tools_of(TOOLS), "llama3_json", None, "r") == (ToolPlan("auto", parser="llama3_json"), None)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_path()))


def test_the_shipped_template_is_smollm2s_own_without_tools_and_renders_tools_calls_and_results(smollm2_tokenizer):
    own = smollm2_tokenizer
    hermes = Tokenizer.from_json(own.to_json())
    hermes.chat_template = load_chat_template("smollm2_hermes")
    for conv in ([{"role": "user", "content": "hi"}], [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]):
        for gen in (True, False):
            assert hermes.apply_chat_template(conv, gen) == own.apply_chat_template(conv, gen)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = hermes.apply_chat_template([*USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                                       {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}], tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text and "<tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def validator(tokenizer: Tokenizer, parser: str | None = "hermes") -> RequestValidator:
    from cluster.messages import Role, WorkerInfo

    info = WorkerInfo("d", Role.DECODE, 1, "smollm2", "smollm2", 16, 100, 2048, tokenizer.vocab_size, 8,
                      tokenizer.to_json())
    return RequestValidator(info, ChatOptions(load_chat_template("smollm2_hermes"), parser))


def check_body(v: RequestValidator, body: dict) -> tuple[str, object]:
    req = parse(ChatCompletionRequest, {"model": "smollm2", "messages": USER, **body})
    checked = v.chat(MessagesRequest("r", chat_turns(req.messages), sampling_fields(req, 64), tool_request(req)))
    return v.tokenizer.decode(checked.token_ids, skip_special_tokens=False), checked


def test_the_validator_renders_tools_and_history_and_plans_the_answer(smollm2_tokenizer):
    v = validator(smollm2_tokenizer)
    text, checked = check_body(v, {"tools": TOOLS})
    assert "<tools>" in text and checked.tools == ToolPlan("auto", parser="hermes")  # type: ignore[attr-defined]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    text, checked = check_body(v, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}, "messages": history})
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "sunny" in text
    assert checked.params.structured.kind == "json"  # type: ignore[attr-defined]
    bad = [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{nope"}}]}]
    for body, field in [({"messages": bad}, "messages[1].tool_calls[0].function.arguments"),
                        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
                        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice")]:
        with pytest.raises(InvalidRequestError) as e:
            check_body(v, body)
        assert e.value.field == field, body
    with pytest.raises(InvalidRequestError) as e:
        check_body(validator(smollm2_tokenizer, parser=None), {"tools": TOOLS})
    assert e.value.field == "tool_choice" and "tool_call_parser" in e.value.reason


def test_the_yaml_options_name_a_shipped_template_or_a_file_and_a_parser(tmp_path):
    cfg = ClusterConfig.from_yaml("deploy/local.yaml")
    assert cfg.router.chat_template == "smollm2_hermes" and cfg.router.tool_call_parser == "hermes"
    settings = cfg.router.router_settings(cfg.model, cfg.mode, "grpc")
    assert settings.chat.template == load_chat_template("smollm2_hermes")
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ClusterConfig.from_yaml_text(f"router:\n  chat_template: {own}\n").router.router_settings(
        "m", "colocated", "grpc").chat.template == own.read_text()
    for text, field in [("router:\n  chat_template: nowhere.jinja\n", "router.chat_template"),
                        ("router:\n  tool_call_parser: mistral\n", "router.tool_call_parser")]:
        with pytest.raises(ConfigError) as e:
            ClusterConfig.from_yaml_text(text)
        assert field in str(e.value) and ":2:" in str(e.value)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_yaml_text(f"router:\n  chat_template: {broken}\n")
    assert "not a Jinja template" in str(e.value)


def test_tokenize_renders_the_tools_as_a_chat_request_does(smollm2_tokenizer):
    from router.openai_tokenize import TokenizeRequest, parse_model, tokenize

    v = validator(smollm2_tokenizer)
    _, checked = check_body(v, {"tools": TOOLS, "tool_choice": "none"})
    counted = tokenize(v, parse_model(TokenizeRequest, {"messages": USER, "tools": TOOLS}))
    assert counted["tokens"] == checked.token_ids and counted["count"] > len(check_body(v, {})[1].token_ids)


def test_grpc_tool_fields_become_the_same_request_and_name_their_fields(smollm2_tokenizer):
    from router.grpc_requests import ProtoValidator
    from router.v1 import inference_pb2 as pb

    v = ProtoValidator(validator(smollm2_tokenizer))
    tool = pb.Tool(name="get_weather", description="Weather of a city", parameters=json.dumps(WEATHER))
    ok = v.chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")], tools=[tool],
                               tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False))
    assert ok.tools == ToolPlan("required", parallel=False) and ok.params.structured is not None
    for req, field in [(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")],
                                       tools=[pb.Tool(name="f", parameters="{bad")]), "tools[0].parameters"),
                       (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], tools=[tool],
                                       tool_choice=pb.ToolChoice(function="nope")), "tool_choice.function"),
                       (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], tools=[tool],
                                       tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice.mode"),
                       (pb.ChatRequest(messages=[pb.ChatMessage(role="assistant", tool_calls=[
                           pb.ToolCall(id="c", name="f", arguments="{")])]), "messages[0].tool_calls[0]"
                        ".function.arguments")]:
        with pytest.raises(InvalidRequestError) as e:
            v.chat(req)
        assert e.value.field == field
