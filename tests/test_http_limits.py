"""What one HTTP client can cost the router's event loop (issue 19 item 9): a body refused before it is read, size
limits before parsing, large bodies off the loop, admission before parsing, a connection cap and a header timeout.

The front is the real one (router/openai_api.py) over a real Router and tokenizer; the requests here are all refused
by the front itself, so no worker is involved.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from router.openai_api import start_http
from router.openai_models import ChatCompletionRequest, parse
from router.openai_params import chat_turns
from tests.unit_router import unit_router

MAX_CONNECTIONS = 4
KEEPALIVE_S = 1.0


@dataclass
class Front:
    router: Any
    port: int
    loop: asyncio.AbstractEventLoop


@pytest.fixture(scope="module")
def front(tiny) -> Iterator[Front]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    router = unit_router(tiny)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    runner, port = on_loop(start_http(router, host="127.0.0.1", port=0, model_name="tiny",
                                      max_connections=MAX_CONNECTIONS, keepalive_timeout_s=KEEPALIVE_S))
    yield Front(router, port, loop)
    on_loop(runner.cleanup())
    on_loop(router.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def raw(port: int, head: bytes, timeout: float = 20.0) -> bytes:
    """Send `head` (a request's start, maybe without its body) and return what the server answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        return s.recv(65536)


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            .encode())


def test_a_body_declared_over_the_limit_is_413_before_it_is_sent(front):
    answer = raw(front.port, post_head("/v1/completions", 17 << 20))  # NOTE: no body follows
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_past_the_admission_limit_a_request_is_429_before_its_body_is_read(front):
    front.router.max_inflight = 0
    try:
        answer = raw(front.port, post_head("/v1/chat/completions", 5000))  # NOTE: no body follows
    finally:
        front.router.max_inflight = 256
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    assert b"max_inflight" in answer


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 5000}, "messages"),
    ({"model": "tiny", "prompt": [1] * 100_000}, "prompt"),
    ({"model": "tiny", "prompt": "x" * ((1 << 20) + 1)}, "prompt"),
], ids=["messages", "token-ids", "characters"])
def test_size_limits_are_400_naming_the_field(front, body, param):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400
    assert json.loads(resp.read())["error"]["param"] == param


def test_a_huge_body_does_not_stall_a_small_request(front):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 300_000}).encode()
    def full_parse() -> float:
        started = time.perf_counter()
        chat_turns(parse(ChatCompletionRequest, json.loads(body)).messages)
        return time.perf_counter() - started

    # NOTE: the reference, in this process: what parsing that body costs (JSON, models, chat turns), all of which
    # the front used to do on its event loop before the message count was checked (before: the worst wait was
    # ~0.9 of it; now: ~0.05, json.loads alone). The least of two runs: a busy machine inflates neither side much.
    full_parse_s = min(full_parse(), full_parse())
    done, latencies = threading.Event(), []

    def probe() -> None:  # /live back to back, each on a new connection: how long the loop keeps a small request
        while not done.is_set():
            t = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
            conn.request("GET", "/live")
            assert conn.getresponse().status == 200
            conn.close()
            latencies.append(time.perf_counter() - t)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    while not latencies:
        time.sleep(0.01)
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    done.set()
    prober.join(60)
    assert resp.status == 400 and answer["error"]["param"] == "messages"
    # the worst wait of a small request while the big one was taken apart, relative to what a full parse costs
    assert max(latencies) < full_parse_s / 4, (max(latencies), full_parse_s)


def test_a_connection_without_a_complete_request_is_closed(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=KEEPALIVE_S * 20) as s:
        s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n")  # a header that never ends (slowloris)
        assert s.recv(1024) == b""  # closed by the server (the timeout of this socket would raise instead)


def test_connections_past_the_cap_get_503(front):
    held = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:  # NOTE: a request on each, so all are open on the server before the next one comes
            s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert raw(front.port, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while not raw(front.port, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200"):
        assert time.monotonic() < deadline, "a connection was refused after the others closed"
        time.sleep(0.05)
