"""The answer to a completion or chat request over HTTP (router/openai_api.py checked it): one JSON object, or with
`stream: true` server-sent events ending in `data: [DONE]`.

The first chunk is awaited before any byte is sent, so overload or a failed prefill is still an HTTP status; after
that a failure is an SSE `error` event. A client that goes away (a failed write, or its handler cancelled) closes
the router's generator, which aborts the request on its workers and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from cluster.logs import REQUEST_ID
from engine.tokenizer import Tokenizer
from router import http_limits as limits
from router.admission import Admission
from router.core import Router
from router.errors import Status
from router.fanout import fan_out
from router.openai_choices import choice_builders, total_usage
from router.openai_errors import error_body
from router.openai_sse import DONE, SSE_HEADERS, extra_of, send, sse, usage_of
from router.results import Chunk
from router.validate import Checked

log = logging.getLogger("router.openai_api")  # NOTE: the logger these lines had (log settings name it)
REQUEST_ID_HEADER = "X-Request-Id"
# NOTE: where a handler leaves the request id for the guard (which echoes it on errors too); a typed key where
# aiohttp has them (3.11+)
RID_KEY: Any = web.RequestKey("pdcluster_request_id", str) if hasattr(web, "RequestKey") else "pdcluster_request_id"
# NOTE: the request's admission slot (router/admission.py), released by the guard when the handler ends
ADMISSION_KEY: Any = (web.RequestKey("pdcluster_admission", Admission) if hasattr(web, "RequestKey")
                      else "pdcluster_admission")


async def answer(router: Router, request: web.Request, body: Any, checked: Checked, oid: str, *, chat: bool,
                 model_name: str, tokenizer: Tokenizer) -> web.StreamResponse:
    """The answer to a checked completion (`chat` False) or chat request: one JSON object, or with `stream` the
    server-sent events; `oid` is its OpenAI id."""
    arrived, created = time.monotonic(), int(time.time())
    stream, include_usage = bool(body.stream), bool(body.stream_options and body.stream_options.include_usage)
    if body.skip_special_tokens is not None:
        checked.params.skip_special_tokens = body.skip_special_tokens
    REQUEST_ID.set(checked.request_id)  # NOTE: set in the handler's task: the tasks it starts inherit it
    request[RID_KEY] = checked.request_id
    id_header = {REQUEST_ID_HEADER: checked.request_id}
    head = {"id": oid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": checked.params.lora or model_name}  # NOTE: as vLLM: the adapter's name
    # NOTE: aclosing: a client that goes away (a failed write, or the handler cancelled) closes the router's
    # generator, which tells the workers to abort the request and free its KV blocks.
    traceparent = request.headers.get("traceparent", "")  # NOTE: the client's W3C trace context, if any
    choices = choice_builders(body, checked.params, checked.token_ids, chat, tokenizer)
    # NOTE: one admission slot: the first run to start takes it over, the others are admitted anew
    admission = request.get(ADMISSION_KEY)
    runs = fan_out(lambda c: _chunks(router, c, arrived, traceparent, admission), checked)
    async with contextlib.aclosing(runs) as chunks:
        first = await anext(chunks)  # NOTE: before any byte is sent, so overload or a failed prefill is a status
        if not stream:
            choices[first.index].add(first)
            async for more in chunks:
                choices[more.index].add(more)
            router.metrics.request_done("http", Status.OK.name)
            whole: dict[str, Any] = {
                **head, "object": "chat.completion" if chat else "text_completion",
                "choices": [c.choice() for c in choices], "usage": usage_of(total_usage(choices)),
                "pdcluster": extra_of(choices[0].last or first)}
            if chat and choices[0].want_prompt_logprobs:
                whole["prompt_logprobs"] = choices[0].prompt_logprobs()
            return web.json_response(whole, headers=id_header)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **id_header})
        await resp.prepare(request)
        limits.bound_stream_buffers(request.transport)
        status = Status.OK
        try:
            if chat:
                for c in choices:
                    await send(resp, head, {"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}, include_usage)
            chunk: Chunk | None = first
            finished = 0
            while chunk is not None:
                delta = choices[chunk.index].delta(chunk)
                if delta is not None:
                    await send(resp, head, delta, include_usage, extra_of(chunk) if chunk.finish_reason else None)
                finished += bool(chunk.finish_reason)
                if chunk.finish_reason and include_usage and finished == len(choices):
                    await sse(resp, {**head, "choices": [], "usage": usage_of(total_usage(choices))})
                chunk = await anext(chunks, None)
        except (ConnectionResetError, asyncio.CancelledError) as e:
            log.info("%s: the client went away; aborting the request", oid)
            if isinstance(e, asyncio.CancelledError):
                raise  # counted by the guard
            router.metrics.request_done("http", Status.CANCELLED.name)
            return resp
        except Exception as e:  # noqa: BLE001 - the status (200) is sent: the error goes in the stream
            _, status, body = error_body(e)
            with contextlib.suppress(ConnectionResetError):
                await sse(resp, body)
        router.metrics.request_done("http", status.name)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(DONE)
            await resp.write_eof()
        return resp


async def _chunks(router: Router, checked: Checked, arrived: float, traceparent: str,
                  admission: Admission | None) -> AsyncGenerator[Chunk, None]:
    """The router's chunks within `router.request_timeout_s`; closing this closes (aborts) the request."""
    budget = router.settings.request_timeout_s
    async with contextlib.aclosing(router.stream_within(checked, arrived, budget, traceparent, admission)) as chunks:
        async for chunk in chunks:
            yield chunk
