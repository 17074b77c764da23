"""What one HTTP client can cost the router's event loop: body size and read time, parse work, connections.

The HTTP front (router/openai_api.py) shares its event loop with gRPC and every streaming response, so:
1. a body is refused before it is read when its Content-Length is over MAX_BODY_BYTES (413), and while it is read
   when a chunked one grows past it (413, aiohttp's `client_max_size`) or takes over BODY_READ_TIMEOUT_S (408);
2. a body over INLINE_PARSE_BYTES is parsed off the loop (a small one inline: a thread hop costs more), and the
   validator's size limits (messages, prompt characters, prompt token ids) are checked on the raw JSON before the
   pydantic models are built: 300k messages would otherwise take seconds to validate before being refused;
3. the server closes a connection that sends no complete request for KEEPALIVE_TIMEOUT_S (idle keep-alive and a
   slow header alike) and takes at most `max_connections` at once (more get a 503 and are closed).
NOTE: json.loads and pydantic hold the GIL, so work in a thread still takes the loop's turns while it runs; what
bounds the stall is refusing oversized input after json.loads (MAX_BODY_BYTES bounds that) instead of after parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from aiohttp import web

from engine.errors import InvalidRequestError
from router.validate import MAX_MESSAGES, MAX_PROMPT_CHARS, run_check

log = logging.getLogger(__name__)
T = TypeVar("T")
# NOTE: as the gRPC server's max message: the longest valid prompt is 1 Mi characters (router/validate.py), up to 12
# bytes each JSON-escaped (a surrogate pair of \uXXXX)
MAX_BODY_BYTES = 16 << 20
BODY_READ_TIMEOUT_S = 30.0  # a body (up to 16 MiB) slower than ~0.5 MiB/s holds a connection for nothing
INLINE_PARSE_BYTES = 64 << 10  # parsed on the loop below this (well under a millisecond)
KEEPALIVE_TIMEOUT_S = 5.0  # as uvicorn's default; aiohttp's own is an hour
MAX_CONNECTIONS = 1024
STREAM_SNDBUF_BYTES = 32 << 10  # a streaming response's kernel send buffer (Linux doubles it)
STREAM_WRITE_BUFFER_BYTES = 16 << 10  # ... and what asyncio holds before a write waits
_BUSY_BODY = json.dumps({"error": {"message": "too many connections", "type": "service_unavailable", "param": None,
                                    "code": None}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def bound_stream_buffers(transport: Any) -> None:
    """Small send buffers for a streaming response, so that a client that stops reading blocks its writes soon.

    NOTE: the kernel grows a loopback socket's send buffer to megabytes and asyncio buffers 64 KiB more: a whole
    generation of SSE chunks would fit, and a client that stopped reading would go unnoticed until the end.
    With the writes blocked, the router's relay (router/relay.py) pauses the worker's stream, and cuts the client
    off after `router.client_stall_timeout_s`.
    """
    if transport is None:
        return
    transport.set_write_buffer_limits(high=STREAM_WRITE_BUFFER_BYTES)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF_BYTES)


async def read_body(request: web.Request) -> bytes:
    """The request body, refused before reading when declared too large (413) and cut off when too slow (408)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length)
    try:
        return await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"the body took over {BODY_READ_TIMEOUT_S:.0f} s to arrive") from None


def load_json(data: bytes, max_model_len: int) -> Any:
    """`data` as JSON, with the validator's size limits checked on the raw value (400 naming the field)."""
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise InvalidRequestError("body", f"is not valid JSON ({e})") from None
    except RecursionError:  # NOTE: deeper than the interpreter's recursion limit: the client's error, not a 500
        raise InvalidRequestError("body", "is nested too deeply") from None
    if isinstance(raw, dict):
        check_sizes(raw, max_model_len)
    return raw


def check_sizes(raw: dict[str, Any], max_model_len: int) -> None:
    """The size limits of router/validate.py on a raw body, before any model is built from it."""
    messages, prompt = raw.get("messages"), raw.get("prompt")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages (got {len(messages)})")
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError("prompt", f"is longer than {MAX_PROMPT_CHARS} characters")
    if isinstance(prompt, list) and len(prompt) > max_model_len:  # token ids (or a batch, which is refused later)
        raise InvalidRequestError("prompt", f"is {len(prompt)} tokens; the model takes at most {max_model_len}")


async def off_loop_if_large(size: int, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline for a body of at most INLINE_PARSE_BYTES, else on `executor`."""
    return await run_check(size <= INLINE_PARSE_BYTES, executor, lambda: fn(*args))


def cap_connections(runner: web.AppRunner, max_connections: int) -> None:
    """Answer 503 and close each connection past `max_connections` (call after `runner.setup()`)."""
    server = runner.server
    assert server is not None, "call after runner.setup()"
    admit = server.connection_made
    refused = [0]

    # NOTE: aiohttp has no connection limit; its Server hears of each new connection here, before any request
    def connection_made(handler: Any, transport: Any) -> None:
        if len(server.connections) >= max_connections:
            refused[0] += 1
            if refused[0] == 1 or refused[0] % 1000 == 0:
                log.warning("HTTP: %d connections open (the limit); refusing new ones (%d so far)",
                            max_connections, refused[0])
            transport.write(_BUSY)
            transport.close()
            return
        admit(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]
