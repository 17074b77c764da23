"""A chat's chunks with its tool calls read out of their text (router/tool_calls.py's plan), for both fronts.

1. each choice (`Chunk.index`) gets its own parser (router/tool_parsers.py); a chunk's text becomes the content
   delta, and the calls' pieces go in `Chunk.tool_calls` (id and name first, then the arguments in pieces);
2. text a parser holds back (a `<tool_call` that may be a tag) goes out with a later chunk or the last one;
3. the last chunk of a choice that made calls and stopped (EOS, a stop string) says "tool_calls" (OpenAI);
4. without parallel_tool_calls only the first call is kept (vLLM's rule for parsed calls; the "required" grammar
   allows one only).
The unary answers merge the pieces (`merge_calls`), so they hold exactly what a stream sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterable

from router.results import Chunk, ToolCallDelta
from router.tool_calls import ToolCall, ToolPlan
from router.tool_parsers import ToolParser


async def tool_chunks(chunks: AsyncGenerator[Chunk, None], plan: ToolPlan) -> AsyncGenerator[Chunk, None]:
    """`chunks` with their text parsed for tool calls; closing this closes `chunks`."""
    parsers: dict[int, ToolParser] = {}
    called: set[int] = set()
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            parser = parsers.get(chunk.index)
            if parser is None:
                parser = parsers[chunk.index] = plan.new_parser()
            content, pieces = parser.feed(chunk.text)
            if chunk.finish_reason:
                more_content, more = parser.finish()
                content, pieces = content + more_content, pieces + more
            if not plan.parallel:
                pieces = [p for p in pieces if p.index == 0]
            chunk.text, chunk.tool_calls = content, pieces
            if pieces:
                called.add(chunk.index)
            if chunk.finish_reason == "stop" and chunk.index in called:
                chunk.finish_reason = "tool_calls"
            yield chunk


def merge_calls(calls: list[ToolCall], pieces: Iterable[ToolCallDelta]) -> None:
    """Add a chunk's pieces to the whole calls so far (in place)."""
    for p in pieces:
        if p.index == len(calls):
            calls.append(ToolCall(p.id, p.name, p.arguments))
        else:
            calls[p.index].arguments += p.arguments
