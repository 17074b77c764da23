"""A request's delta stream from one worker, as a run reads it: over the worker's delta channel, or Ray's generator.

1. `open_stream(worker, request, window)` returns at once (the run opens the handoff's stream together with its
   prefill); the stream starts in a task of its own: it connects this router to the worker's delta channel if it
   is not yet (`DeltaChannel`: the worker's address and secret come through Ray; cluster/delta_server.py is the
   other end), then makes the Ray call `stream(request, channel)`; a worker that offers no channel (a KV plane
   with TLS) streams through a Ray streaming generator instead, as every worker did before;
2. `next(timeout)` is the next Delta (StopAsyncIteration after the last one); a failed worker raises here: its Ray
   call's error, its channel closing (the process died), or the exception its generator ended with;
3. each delta taken is acknowledged to the worker (batched: one frame per round of the event loop for all the
   channel's streams), which keeps at most `window` unacknowledged: a client that reads slowly pauses the worker's
   stream, as Ray's generator window did;
4. `close()` before the end cancels the stream on the worker (its request is aborted there, its blocks freed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.delta_server import END, frame, hello, read_frame
from cluster.messages import DecodeRequest, Delta
from router.errors import WorkerFailed

log = logging.getLogger(__name__)


class DeltaStream(Protocol):
    async def next(self, timeout: float) -> Delta: ...

    def close(self) -> None: ...


class RayStream:
    """A Ray streaming generator of Deltas (one Ray object per delta, `window` unread at most)."""

    def __init__(self, actor: Any, request: DecodeRequest, window: int) -> None:
        self._gen = actor.generate.options(num_returns="streaming",
                                           _generator_backpressure_num_objects=window).remote(request)

    async def next(self, timeout: float) -> Delta:
        ref = await asyncio.wait_for(anext(self._gen), timeout)
        return await ref  # type: ignore[no-any-return]

    def close(self) -> None:
        pass


class DeltaChannel:
    """This router's connection to one worker's delta channel: read by one task, shared by all its streams."""

    def __init__(self, worker_name: str) -> None:
        self.worker_name = worker_name
        self.channel = uuid.uuid4().hex  # this router's name on the worker
        self.streams: dict[str, ChannelStream] = {}
        self.available: bool | None = None  # None: not asked yet; False: the worker has no channel (use Ray)
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._acks: dict[str, int] = {}
        self._cancels: list[str] = []

    async def connect(self, actor: Any) -> bool:
        """Connected (True), or the worker offers no channel (False); raises what the worker's Ray call raised."""
        if self._writer is not None and not self._writer.is_closing():
            return True
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._dial(actor))
        dial = self._connecting
        try:
            await asyncio.shield(dial)
        finally:
            if dial.done() and self._connecting is dial:
                self._connecting = None
        return self._writer is not None

    async def _dial(self, actor: Any) -> None:
        address, secret = await actor.stream_endpoint.remote()
        self.available = bool(address)
        if not address:
            return
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(hello(secret, self.channel))
        welcome = await asyncio.wait_for(read_frame(reader), 10.0)
        if welcome != ("welcome",):
            writer.close()
            raise ConnectionError(f"{self.worker_name}'s delta channel answered {welcome!r}")
        self._writer = writer
        asyncio.ensure_future(self._read(reader, writer))

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                _, items = await read_frame(reader)
                for attempt, item in items:
                    stream = self.streams.get(attempt)
                    if stream is not None:
                        stream.put(item)
        except Exception as e:  # noqa: BLE001 - the worker died or the connection broke: its streams fail over
            if self._writer is writer:
                self._writer = None
            writer.close()
            lost = WorkerFailed(f"worker {self.worker_name}'s delta channel closed ({type(e).__name__})")
            for stream in list(self.streams.values()):
                stream.put(lost)

    def ack(self, attempt: str, n: int) -> None:
        self._queue_control()
        self._acks[attempt] = self._acks.get(attempt, 0) + n

    def cancel(self, attempt: str) -> None:
        self.streams.pop(attempt, None)
        self._queue_control()
        self._cancels.append(attempt)

    def _queue_control(self) -> None:
        if not self._acks and not self._cancels:  # NOTE: the first of this round: one frame when the round ends
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        acks, self._acks = self._acks, {}
        cancels, self._cancels = self._cancels, []
        writer = self._writer
        if writer is None or writer.is_closing():
            return
        if acks:
            writer.write(frame(("ack", acks)))
        if cancels:
            writer.write(frame(("cancel", cancels)))


class ChannelStream:
    """One stream over a worker's delta channel (or, where the worker has none, its Ray generator)."""

    def __init__(self, worker: Any, channel: DeltaChannel, request: DecodeRequest, window: int) -> None:
        self.attempt = request.request_id
        self.channel = channel
        self.ack_every = max(1, window // 4)
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._untold = 0  # deltas taken and not yet acknowledged
        self._ended = False
        self._ray: RayStream | None = None
        self._call: Any = None
        self._started = asyncio.ensure_future(self._start(worker, request, window))

    async def _start(self, worker: Any, request: DecodeRequest, window: int) -> None:
        if not await self.channel.connect(worker.actor):
            self._ray = RayStream(worker.actor, request, window)
            return
        self.channel.streams[self.attempt] = self
        self._call = worker.actor.stream.remote(request, self.channel.channel)
        asyncio.wrap_future(self._call.future()).add_done_callback(self._called)

    def _called(self, fut: asyncio.Future[None]) -> None:
        """The worker's Ray call ended: an error (the actor died, no channel) ends the stream if nothing else has."""
        if not fut.cancelled() and fut.exception() is not None:
            self.put(fut.exception())

    def put(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float) -> Delta:
        if not self._started.done():
            await asyncio.wait_for(asyncio.shield(self._started), timeout)
        self._started.result()  # NOTE: raises what the start raised (the worker died before it answered)
        if self._ray is not None:
            return await self._ray.next(timeout)
        if self._ended:
            raise StopAsyncIteration
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item == END:
            self._end()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        self._untold += 1
        if self._untold >= self.ack_every:
            self.channel.ack(self.attempt, self._untold)
            self._untold = 0
        assert isinstance(item, Delta)
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self._ended = True
        self.channel.streams.pop(self.attempt, None)

    def close(self) -> None:
        """Let the stream go: a stream that has not ended is cancelled on the worker (its request aborted)."""
        if not self._started.done():
            self._started.cancel()
        elif self._started.cancelled() or self._started.exception() is not None:
            pass  # NOTE: exception() marks it retrieved: no "never retrieved" warning
        elif not self._ended and self._ray is None:
            self.channel.cancel(self.attempt)
        self._ended = True
        self.channel.streams.pop(self.attempt, None)


def open_stream(worker: Any, request: DecodeRequest, window: int) -> DeltaStream:
    """`request`'s deltas from `worker` (a router.pools.WorkerHandle): its delta channel, else its Ray generator."""
    if worker.channel.available is False or not hasattr(worker.actor, "stream_endpoint"):
        return RayStream(worker.actor, request, window)
    return ChannelStream(worker, worker.channel, request, window)


@dataclass
class OpenStream:
    """A decode stream the run opened: its worker, its deltas, the attempt's span."""

    worker: Any  # router.pools.WorkerHandle
    attempt_id: str
    stream: DeltaStream
    span: Any
    handoff: bool  # takes a transferred KV (the worker works out the first token's characters itself)
