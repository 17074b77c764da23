"""The answer's wire pieces: OpenAI's usage object, pdcluster's own extra fields, server-sent events."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from router.results import Chunk, Timeline, Usage, fields_of

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"

def usage_of(u: Usage | None) -> dict[str, Any]:
    """OpenAI's usage object (cached prompt tokens under prompt_tokens_details)."""
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def extra_of(last: Chunk) -> dict[str, Any]:
    """pdcluster's own fields (ignored by OpenAI clients): the request id and its timeline."""
    return {"request_id": last.request_id, "timeline": fields_of(last.timeline or Timeline())}


async def sse(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    """One server-sent event."""
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def send(resp: web.StreamResponse, head: dict[str, Any], choice: dict[str, Any], include_usage: bool,
               extra: dict[str, Any] | None = None) -> None:
    """One streamed chunk (`usage: null` on each when usage was asked for, as OpenAI does)."""
    obj: dict[str, Any] = {**head, "choices": [choice]}
    if include_usage:
        obj["usage"] = None
    if extra is not None:
        obj["pdcluster"] = extra
    await sse(resp, obj)
