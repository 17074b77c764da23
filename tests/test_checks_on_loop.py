"""Which request checks the router runs on its event loop and which on a thread (router/validate.py).

A small check (a short text to tokenize, token ids) runs on the loop: the hop to a thread and back costs more than
it. A long text, a grammar or tools go to a thread, so no check stalls the streams the loop relays. Both fronts
follow the same rule: gRPC on its protobuf requests, HTTP on the plain requests it builds.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from engine.grammar import StructuredOutputSpec
from router.grpc_requests import ProtoValidator, Undecodable
from router.tool_calls import ToolFunction, ToolRequest
from router.v1 import inference_pb2 as pb
from router.validate import (
    INLINE_CHECK_CHARS,
    INLINE_CHECK_TOKEN_IDS,
    ChatTurn,
    MessagesRequest,
    PromptRequest,
    SamplingFields,
    run_check,
)

JSON = pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True))


def test_grpc_requests_small_ones_on_the_loop_long_text_grammars_and_tools_on_a_thread() -> None:
    on_loop = ProtoValidator.on_loop
    assert on_loop(pb.GenerateRequest(prompt="Hello there"))
    assert on_loop(pb.GenerateRequest(prompt="x" * INLINE_CHECK_CHARS))
    assert on_loop(pb.GenerateRequest(prompt_token_ids=range(75)))
    assert not on_loop(pb.GenerateRequest(prompt="x" * (INLINE_CHECK_CHARS + 1)))
    assert not on_loop(pb.GenerateRequest(prompt_token_ids=[1] * (INLINE_CHECK_TOKEN_IDS + 1)))
    assert not on_loop(pb.GenerateRequest(prompt="Hello", sampling=JSON))

    user = pb.ChatMessage(role="user", content="What is the capital of France?")
    assert on_loop(pb.ChatRequest(messages=[pb.ChatMessage(role="system", content="Be brief."), user]))
    assert not on_loop(pb.ChatRequest(messages=[user, pb.ChatMessage(role="user", content="y" * INLINE_CHECK_CHARS)]))
    assert not on_loop(pb.ChatRequest(messages=[user], tools=[pb.Tool(name="get_weather")]))
    assert not on_loop(pb.ChatRequest(messages=[user], sampling=JSON))
    assert on_loop(Undecodable("GenerateRequest", "invalid UTF-8"))  # its check only raises


def test_http_requests_follow_the_same_rule() -> None:
    assert PromptRequest("r", prompt="Hello there").checks_on_loop()
    assert PromptRequest("r", prompt_token_ids=list(range(75))).checks_on_loop()
    assert not PromptRequest("r", prompt="x" * (INLINE_CHECK_CHARS + 1)).checks_on_loop()
    assert not PromptRequest("r", prompt="Hi", sampling=SamplingFields(
        structured=StructuredOutputSpec.json_schema({"type": "object"}))).checks_on_loop()

    turns = [ChatTurn("user", "What is the capital of France?")]
    assert MessagesRequest("r", turns).checks_on_loop()
    assert not MessagesRequest("r", turns, tools=ToolRequest([ToolFunction("get_weather")])).checks_on_loop()
    assert not MessagesRequest("r", [*turns, ChatTurn("user", "y" * INLINE_CHECK_CHARS)]).checks_on_loop()


def test_run_check_runs_a_small_check_here_and_a_large_one_on_the_executor() -> None:
    async def main() -> tuple[str, str, str]:
        with ThreadPoolExecutor(1, thread_name_prefix="checks") as executor:
            here = await run_check(True, executor, lambda: threading.current_thread().name)
            there = await run_check(False, executor, lambda: threading.current_thread().name)
        return threading.current_thread().name, here, there

    loop_thread, here, there = asyncio.run(main())
    assert here == loop_thread
    assert there.startswith("checks") and there != loop_thread
