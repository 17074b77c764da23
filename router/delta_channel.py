"""DeltaChannel: this router's one connection to a worker's delta channel (cluster/delta_server.py is the other end).

1. the first stream for a worker connects (`connect`): the worker's address and secret come through Ray (which
   authenticates this router), then a plain-bytes hello and the worker's welcome; a worker with no channel (a KV
   plane with TLS) answers no address, and its streams go through Ray (router/streams.py);
2. one task reads the connection: each frame's items go to their streams (`ChannelStream.put`), by attempt id;
3. acknowledgements and cancels of all the channel's streams leave as one frame per round of the event loop;
4. a connection that breaks (the worker died) fails every stream on it at once, with WorkerFailed.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

from cluster.delta_wire import frame, from_wire, hello, read_frame
from router.errors import WorkerFailed


class ChannelStream(Protocol):
    """What the channel needs of a stream on it (router/streams.py)."""

    attempt: str
    kind: str

    def put(self, item: object) -> None: ...


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
        self._reader: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self, actor: Any) -> bool:
        """Connected (True), or the worker offers no channel (False); raises what the worker's Ray call raised."""
        if self.connected:
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
        self._reader = asyncio.ensure_future(self._read(reader, writer))

    def close(self) -> None:
        """Drop the connection (the router is stopping): the worker ends the streams that were on it."""
        if self._reader is not None:
            self._reader.cancel()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                _, items = await read_frame(reader)
                for attempt, item in items:
                    stream = self.streams.get(attempt)
                    if stream is not None:
                        stream.put(from_wire(item))
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

    def open(self, stream: ChannelStream, request: Any, window: int) -> None:
        """Ask the worker for `stream` (a stream or a call); a connection already gone fails it at once."""
        writer = self._writer
        if writer is None or writer.is_closing():
            stream.put(WorkerFailed(f"worker {self.worker_name}'s delta channel closed"))
            return
        writer.write(frame(("open", stream.attempt, stream.kind, request, window)))

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
