"""The delta channel between a worker and a router (cluster/delta_server.py, router/streams.py) over a real socket.

What a user would notice: every delta once and in order; a step's deltas for all streams in one message (the
router's cost per step, not per token); a client that reads nothing pauses its stream at the window; a request
whose client went away is ended on the worker; a worker that dies fails its streams at once; a peer without the
secret gets nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from cluster.delta_server import DeltaServer
from cluster.delta_wire import frame, read_frame
from cluster.frame_writer import FrameWriter
from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult
from engine import SamplingParams
from router.delta_channel import DeltaChannel
from router.errors import WorkerFailed
from router.streams import PrefillCall, open_stream


class Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class Worker:
    """A worker's side: a DeltaServer whose `generate` yields `n` deltas, one per `tick`, and records its life."""

    def __init__(self, ticks: asyncio.Queue[None] | None = None) -> None:
        self.server = DeltaServer("127.0.0.1", {"generate": self.generate, "prefill": self.prefill})
        self.ticks = ticks
        self.made: dict[str, int] = {}
        self.closed: set[str] = set()

    async def generate(self, req: DecodeRequest) -> AsyncGenerator[Delta, None]:
        n = req.params.max_tokens
        try:
            for i in range(n):
                if self.ticks is not None:
                    await self.ticks.get()
                self.made[req.request_id] = i + 1
                yield Delta([i], f"<{i}>", finished=i == n - 1, finish_reason="length" if i == n - 1 else None)
        finally:
            self.closed.add(req.request_id)

    async def prefill(self, req: PrefillRequest) -> AsyncGenerator[PrefillResult, None]:
        yield PrefillResult(req.request_id, [7], "<7>", False, None, "", 3, 0, 0.0, 1.0, 0.0, handed_off=False)
        yield PrefillResult(req.request_id, [7], "<7>", False, None, "", 3, 0, 0.0, 1.0, 2.5, 4, 4096)


class Handle:
    """What router.streams needs of a router.pools.WorkerHandle: the actor (endpoint only) and its channel."""

    def __init__(self, worker: Worker) -> None:
        self.name = "w"
        self.actor = type("Actor", (), {})()
        self.actor.stream_endpoint = Remote(worker.server.endpoint)
        self.channel = DeltaChannel("w")


def request(rid: str, n: int, window: int = 16) -> DecodeRequest:
    return DecodeRequest(rid, SamplingParams(max_tokens=n), window=window)


async def drain(stream: Any) -> list[int]:
    out: list[int] = []
    while True:
        try:
            d = await stream.next(5.0)
        except StopAsyncIteration:
            return out
        out += d.token_ids


def test_every_delta_arrives_once_in_order_and_a_steps_deltas_travel_together() -> None:
    async def main() -> None:
        ticks: asyncio.Queue[None] = asyncio.Queue()
        worker = Worker(ticks)
        handle = Handle(worker)
        frames = [0]
        real = DeltaChannel._read

        async def counting(self: DeltaChannel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            orig = reader.readexactly

            async def readexactly(n: int) -> bytes:
                data = await orig(n)
                if n == 4:
                    frames[0] += 1
                return data
            reader.readexactly = readexactly  # type: ignore[method-assign]
            await real(self, reader, writer)

        DeltaChannel._read = counting  # type: ignore[method-assign]
        try:
            streams = [open_stream(handle, request(f"r{i}", 5), 16) for i in range(8)]
            reads = [asyncio.ensure_future(drain(s)) for s in streams]
            await asyncio.sleep(0.2)
            before = frames[0]
            for _ in range(5):  # one step: every stream's generator makes its next delta in the same round
                for _ in streams:
                    ticks.put_nowait(None)
                await asyncio.sleep(0.05)
            got = await asyncio.gather(*reads)
        finally:
            DeltaChannel._read = real  # type: ignore[method-assign]
        assert got == [[0, 1, 2, 3, 4]] * 8
        # 5 steps of 8 streams each (plus each stream's END): a frame per step, not per delta
        assert frames[0] - before <= 10, frames[0] - before
        worker.server.close()

    asyncio.run(main())


def test_a_stream_nobody_reads_stops_at_its_window_and_resumes_when_read() -> None:
    async def main() -> None:
        worker = Worker()
        handle = Handle(worker)
        stream = open_stream(handle, request("slow", 100, window=4), 4)
        first = await stream.next(5.0)
        await asyncio.sleep(0.3)
        assert first.token_ids == [0]
        # the worker runs at most a window ahead of what the router took (acknowledged in halves of it)
        assert worker.made["slow"] <= 1 + 4 + 2, worker.made
        assert await drain(stream) == list(range(1, 100))
        worker.server.close()

    asyncio.run(main())


def test_a_stream_closed_early_ends_its_generator_on_the_worker() -> None:
    async def main() -> None:
        worker = Worker()
        handle = Handle(worker)
        stream = open_stream(handle, request("gone", 1000, window=2), 2)
        await stream.next(5.0)
        stream.close()
        for _ in range(100):
            if "gone" in worker.closed:
                break
            await asyncio.sleep(0.02)
        assert "gone" in worker.closed
        assert worker.made["gone"] < 1000
        worker.server.close()

    asyncio.run(main())


def test_a_worker_that_goes_away_fails_its_streams_at_once() -> None:
    async def main() -> None:
        ticks: asyncio.Queue[None] = asyncio.Queue()
        worker = Worker(ticks)
        handle = Handle(worker)
        stream = open_stream(handle, request("orphan", 10), 16)
        ticks.put_nowait(None)
        assert (await stream.next(5.0)).token_ids == [0]
        worker.server.close()  # the worker's process is gone: its connections close
        with pytest.raises(WorkerFailed):
            await stream.next(5.0)

    asyncio.run(main())


def test_a_prefill_call_gives_the_first_token_then_the_hand_offs_result() -> None:
    async def main() -> None:
        worker = Worker()
        handle = Handle(worker)
        call = PrefillCall(handle, PrefillRequest("p", [1, 2, 3], SamplingParams(), "x:1"))
        first = await call.first(5.0)
        assert first.token_ids == [7] and not first.handed_off
        final = await call.final(5.0)
        assert final.handed_off and final.transfer_ms == 2.5 and final.kv_bytes_sent == 4096
        call.close()
        worker.server.close()

    asyncio.run(main())


def test_a_peer_without_the_secret_is_refused_before_anything_is_unpickled() -> None:
    async def main() -> None:
        worker = Worker()
        address, _ = await worker.server.endpoint()
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frame(("open", "x", "generate", request("x", 3), 16)))  # a pickle, not the hello
        with contextlib.suppress(ConnectionError):
            assert await reader.read() == b""  # closed without an answer
        reader, writer = await asyncio.open_connection(host, int(port))
        data = b"hello wrong-secret router"
        writer.write(len(data).to_bytes(4, "big") + data)
        assert await reader.read() == b""
        assert not worker.made
        # and the right secret is welcomed
        _, secret = await worker.server.endpoint()
        reader, writer = await asyncio.open_connection(host, int(port))
        data = f"hello {secret} router".encode()
        writer.write(len(data).to_bytes(4, "big") + data)
        assert await asyncio.wait_for(read_frame(reader), 5) == ("welcome",)
        writer.close()
        worker.server.close()

    asyncio.run(main())


def test_a_connection_nobody_reads_never_blocks_the_engine_thread_and_loses_no_delta() -> None:
    """The engine thread sends a step's frame whatever the router does: into a full socket the call still returns at
    once, and what the socket could not take goes out later, whole and in order, once the router reads again."""
    async def main() -> None:
        worker_side, router_side = socket.socketpair()
        _, transport = await asyncio.open_connection(sock=worker_side)
        out = FrameWriter(transport.get_extra_info("socket"), asyncio.get_running_loop())

        def engine_thread() -> None:  # ~4 MiB of deltas: far more than the socket's buffers hold
            for step in range(400):
                out.put("s", ("x" * 10_000, step))
                out.flush()

        await asyncio.wait_for(asyncio.to_thread(engine_thread), 30)
        reader, _ = await asyncio.open_connection(sock=router_side)
        steps: list[int] = []
        while len(steps) < 400:
            kind, items = await asyncio.wait_for(read_frame(reader), 10)
            assert kind == "deltas"
            steps += [step for _, (_, step) in items]
        assert steps == list(range(400))
        out.close()
        transport.close()

    asyncio.run(main())
