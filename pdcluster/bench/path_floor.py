"""The floor of `pdcluster bench path`'s router CPU: what a bare server of the same library spends per streamed token.

The router writes each token of each stream as one message: one protobuf message and `context.write` on grpc.aio,
one SSE event (JSON) and one socket write on aiohttp. A server that does only that, and nothing of the router's
(no relay, no detokenizer, no worker channel), shows what part of the router's CPU per token is the front's library.
`floor` starts one in a child process, runs `streams` concurrent streams of `tokens` tokens through it with the bench's
own clients, every stream writing one token per tick of `gap_s` (the pace of the cluster's run: all streams' tokens
of a step leave together, as the decode worker's step makes them; with `every` > 1, one message for each `every`
tokens, as the router's `stream_interval` sends them), and returns the server process's CPU seconds per
1,000 tokens, net of its idle CPU as the router's figure is. The server reads its CPU from its own process clock
(nanoseconds) when asked: /proc's 10 ms ticks were too coarse for its idle CPU at a slow pace (a SmolLM2 run's
0.2 s ticks), which is taken out of the whole run. `floor_per_request`: the same server answering short requests one
after another, its CPU per request (a call set up, its few messages, its end) beside the router's of the TTFT case.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

from pdcluster.event_loop import EventLoop, run

IDLE_S = 1.0  # the bare server's idle CPU is measured over this long
Stream = Callable[[str, list[int], int], Awaitable[Any]]  # the bench's client of a front (bench/path_clients.py)


async def _ticks(gap_s: float, tick: asyncio.Event) -> None:
    while True:
        await asyncio.sleep(gap_s)
        tick.set()  # NOTE: wakes every stream waiting now; cleared for the next tick
        tick.clear()


def _messages(tokens: int, every: int) -> list[list[int]]:
    """A stream's token ids as its messages carry them (`every` a message, the last one what is left)."""
    return [list(range(i, min(i + every, tokens))) for i in range(0, tokens, every)]


async def _ticked(tick: asyncio.Event, n: int) -> None:
    for _ in range(n):
        await tick.wait()


async def _grpc_server(gap_s: float, every: int, ports: Any) -> None:
    import grpc

    from router.v1 import inference_pb2 as pb
    from router.v1 import inference_pb2_grpc as pb_grpc

    tick = asyncio.Event()

    class Bare(pb_grpc.InferenceServicer):
        async def GenerateStream(self, request: Any, context: Any) -> None:
            for ids in _messages(request.sampling.max_tokens, every):
                await _ticked(tick, len(ids))
                await context.write(pb.GenerateChunk(request_id="bare", token_ids=ids, text=" tok" * len(ids), index=0))

    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Bare(), server)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await _ticks(gap_s, tick)


async def _http_server(gap_s: float, every: int, ports: Any) -> None:
    from aiohttp import web

    tick = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for ids in _messages(body["max_tokens"], every):
            await _ticked(tick, len(ids))
            event = {"id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "bare",
                     "choices": [{"index": 0, "text": " tok" * len(ids), "token_ids": ids, "logprobs": None,
                                  "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    ports.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await _ticks(gap_s, tick)


def _answer_cpu(conn: Connection) -> None:
    """Each message asks for the process's CPU seconds so far (every thread's: its own clock, not /proc's ticks)."""
    while True:
        conn.recv()
        conn.send(time.process_time())


def _serve(front: str, gap_s: float, every: int, loop: EventLoop, ports: Any, conn: Connection) -> None:
    threading.Thread(target=_answer_cpu, args=(conn,), daemon=True).start()
    run(_grpc_server(gap_s, every, ports) if front == "grpc" else _http_server(gap_s, every, ports), loop)


def _net_cpu_s(front: str, stream: Stream, gap_s: float, every: int, loop: EventLoop, streams: int, tokens: int,
               rounds: int) -> float:
    """A bare `front` server in a child process streams `rounds` x `streams` x `tokens` tokens to `stream` (each
    round's streams at once, the rounds one after another): its CPU seconds for them, net of its idle CPU."""
    ctx = mp.get_context("spawn")
    ports, (ask, answer) = ctx.Queue(), ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(front, gap_s, every, loop, ports, answer), daemon=True)
    proc.start()

    def cpu_s() -> float:
        ask.send(None)
        return float(ask.recv())

    try:
        addr = f"127.0.0.1:{ports.get(timeout=60)}"
        asyncio.run(_client(stream, addr, 2, 4, 1))  # warm-up: the connection and the first calls
        cpu0, t = cpu_s(), time.perf_counter()
        time.sleep(IDLE_S)
        idle_rate = (cpu_s() - cpu0) / (time.perf_counter() - t)
        cpu0, t = cpu_s(), time.perf_counter()
        got = asyncio.run(_client(stream, addr, streams, tokens, rounds))
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - t
    finally:
        proc.kill()
        proc.join(10)
    if got != rounds * streams * tokens:
        raise RuntimeError(f"the bare {front} server streamed {got} of {rounds} x {streams} x {tokens} tokens")
    return max(0.0, cpu - idle_rate * wall)


def floor(front: str, stream: Stream, streams: int, tokens: int, gap_s: float, every: int = 1,
          loop: EventLoop = "auto") -> float:
    """CPU seconds per 1,000 tokens of a bare `front` server (grpc, http) streaming `streams` x `tokens` tokens,
    one per stream every `gap_s` (`every` a message), to `stream` (the bench's client of that front), net of the
    server's idle CPU; the server runs on the event loop `loop` gives (the router's `event_loop`)."""
    return _net_cpu_s(front, stream, gap_s, every, loop, streams, tokens, 1) / (streams * tokens) * 1e3


def floor_per_request(front: str, stream: Stream, requests: int, tokens: int, loop: EventLoop = "auto") -> float:
    """CPU milliseconds per request of a bare `front` server answering `requests` requests of `tokens` tokens one
    after another, as the bench's TTFT case sends them (the server writes a token a millisecond), net of its idle
    CPU: the library's share of the router's CPU per request (a call set up, its messages, its end)."""
    return _net_cpu_s(front, stream, 0.001, 1, loop, 1, tokens, requests) / requests * 1e3


async def _client(stream: Stream, addr: str, streams: int, tokens: int, rounds: int) -> int:
    """Tokens streamed: `rounds` rounds, one after another, of `streams` streams at once."""
    from pdcluster.bench.path_clients import close_all

    try:
        got = 0
        for _ in range(rounds):
            runs = await asyncio.gather(*(stream(addr, [1, 2, 3], tokens) for _ in range(streams)))
            got += sum(r.tokens for r in runs)
        return got
    finally:
        await close_all()
