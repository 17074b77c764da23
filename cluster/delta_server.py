"""DeltaServer: a worker's one connection per router that carries every stream's deltas, each step's as one message.

NOTE: as vLLM's engine core sends one message of all requests' outputs per step (ZMQ) and SGLang's scheduler one
per batch to its detokenizer, the cost of the path then scales with steps, not with tokens × streams: a Ray
streaming generator per request made one Ray object per delta, each read by the router's core worker.
Life of a connection and of the streams on it:
1. a router asks the worker (through Ray, which authenticates it) for `endpoint()`: an address and a secret; it
   connects, sends `("hello", secret, channel)` and waits for `("welcome",)`; the connection is now channel
   `channel` (the router's id) on this worker;
2. the router opens a request's stream with `("open", attempt, "generate", request, window)`: the worker's delta
   generator runs; its RequestStream (cluster/request_stream.py) takes the stream's `Relay` and the engine thread
   queues each output's delta on the connection itself and sends the step's frame at the step's end
   (cluster/frame_writer.py): no event-loop hop per token. A `"prefill"` call's first token leaves the same way
   (prefill_workers/worker.py). What a handler yields (the prefill call's final result; a decode stream given up
   before it began) is queued by the event loop and leaves when its round ends. A frame is
   `("deltas", [(attempt, item), ...])`, where the item is a Delta (most as a tuple: `to_wire`), a call's result,
   END (the generator returned) or the exception that ended it; no Ray call is made per request (Ray's round
   trip was ~5 ms of a first token here);
3. backpressure as Ray's generator window had it: with `window` deltas of a stream not yet acknowledged (the
   router acknowledges as its client takes them: `("ack", {attempt: n})`) the stream's sequence pauses in the
   engine (cluster/backlog.py) until acknowledgements come (a handler's own items: `serve` waits before reading
   the next one);
4. a router that cancels a stream (`("cancel", [attempt])`: its client went away) or whose connection drops (the
   router died) ends its streams here: the generators close, which aborts their requests and frees their blocks.
Frames: cluster/delta_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import secrets
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cluster.delta_wire import END, frame, read_bytes, read_frame, sendable, to_wire
from cluster.frame_writer import FrameWriter
from cluster.outlet import Outlet

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0


class Relay:
    """A stream's way from the engine thread straight onto its connection: each output's delta is queued there as
    it is made and the step's frame is sent at the step's end, with no hop through the event loop.

    A stream that takes the relay (`take_relay()`, cluster/request_stream.py) sends its deltas with
    `send_at_step_end` (the engine thread flushes the connection after the step) and hears the router's
    acknowledgements through `on_ack` (its backpressure: the sequence pauses in the engine with a window of deltas
    unacknowledged); its generator then yields nothing and returns when the request is over, and END follows its
    last delta on the connection."""

    def __init__(self, out: FrameWriter, attempt: str) -> None:
        self.attempt = attempt
        self.flush = out.flush  # NOTE: one bound method per connection: a step flushes each connection once
        self._out = out
        self.on_ack: Callable[[int], None] | None = None
        self.taken = False

    def send_at_step_end(self, item: object, outlet: Outlet) -> None:
        """(the engine thread, in a sink) queue one delta, as `to_wire` has it, for the step's frame: `outlet` has
        the engine thread flush the connection once the step's sinks have all run."""
        self._out.put(self.attempt, item)
        outlet.send_after_step(self.flush)


_RELAY: contextvars.ContextVar[Relay | None] = contextvars.ContextVar("pdcluster_relay", default=None)


def take_relay() -> Relay | None:
    """The relay of the channel stream whose handler runs this code (once: the first caller takes it), or None
    (a Ray stream, a call, or a test that runs the handler itself)."""
    relay = _RELAY.get()
    if relay is None or relay.taken:
        return None
    relay.taken = True
    return relay


class _Stream:
    """One stream on a connection: its unacknowledged deltas and the task that serves it."""

    def __init__(self, window: int, relay: Relay | None) -> None:
        self.window = max(1, window)
        self.unacked = 0
        self.room = asyncio.Event()
        self.room.set()
        self.task = asyncio.current_task()
        self.cancelled = False
        self.relay = relay

    def acked(self, n: int) -> None:
        if self.relay is not None and self.relay.on_ack is not None:  # NOTE: its deltas went by the relay
            self.relay.on_ack(n)
            return
        self.unacked -= n
        if self.unacked < self.window:
            self.room.set()

    def cancel(self) -> None:
        if not self.cancelled and self.task is not None:
            self.cancelled = True
            self.task.cancel()


class _Connection:
    """One router's connection: its streams and its writer."""

    def __init__(self, channel: str, writer: asyncio.StreamWriter) -> None:
        self.channel, self.writer = channel, writer
        self.out = FrameWriter(writer.get_extra_info("socket"), asyncio.get_running_loop())
        self.streams: dict[str, _Stream] = {}

    def send(self, attempt: str, item: object) -> None:
        """(the event loop) queue `item`; the frame leaves once this round of the loop is over."""
        if self.out.put(attempt, item):
            asyncio.get_running_loop().call_soon(self.out.flush)

    def close(self) -> None:
        for stream in list(self.streams.values()):
            stream.cancel()
        self.out.close()
        self.writer.close()


Handler = Callable[[Any], AsyncGenerator[Any, None]]  # a request -> its items (Deltas; a prefill's two results)


class DeltaServer:
    """The worker's delta channel: started on the actor's event loop at the first `endpoint()`.

    `handlers` name what a router may open; each returns an async generator whose items go to the router under the
    stream's window (a decode stream's Deltas, a prefill call's first token and final result)."""

    def __init__(self, host: str, handlers: dict[str, Handler]) -> None:
        self.host = host
        self.handlers = handlers
        self.secret = secrets.token_hex(16)
        self.address = ""
        self._server: asyncio.Server | None = None
        self._connections: dict[str, _Connection] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def endpoint(self) -> tuple[str, str]:
        """(host:port, secret) of this worker's delta channel; the server starts at the first call."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.address = f"{self.host}:{port}"
            log.info("delta channel listening on %s", self.address)
        return self.address, self.secret

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            words = (await asyncio.wait_for(read_bytes(reader, 1024), HELLO_TIMEOUT_S)).split()
        except (Exception, asyncio.TimeoutError):  # noqa: BLE001 - a stranger or a dropped dial: closed
            writer.close()
            return
        if len(words) != 3 or words[0] != b"hello" or not hmac.compare_digest(words[1], self.secret.encode()):
            log.warning("delta channel: a peer without the secret was turned away")
            writer.close()
            return
        conn = _Connection(words[2].decode(), writer)
        old = self._connections.pop(conn.channel, None)
        if old is not None:
            old.close()
        self._connections[conn.channel] = conn
        conn.out.write(frame(("welcome",)))
        try:
            while True:
                msg = await read_frame(reader)
                if msg[0] == "open":
                    _, attempt, kind, request, window = msg
                    task = asyncio.ensure_future(self._run(conn, attempt, kind, request, window))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif msg[0] == "ack":
                    for attempt, n in msg[1].items():
                        if (stream := conn.streams.get(attempt)) is not None:
                            stream.acked(n)
                elif msg[0] == "cancel":
                    for attempt in msg[1]:
                        if (stream := conn.streams.get(attempt)) is not None:
                            stream.cancel()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if self._connections.get(conn.channel) is conn:
                del self._connections[conn.channel]
            if conn.streams:
                log.warning("router channel %s closed with %d streams open: ending them", conn.channel,
                            len(conn.streams))
            conn.close()

    async def _run(self, conn: _Connection, attempt: str, kind: str, request: Any, window: int) -> None:
        """One stream or call opened by a router: its items on `conn` until END, an error, or the router's cancel."""
        relay = Relay(conn.out, attempt)
        stream = conn.streams[attempt] = _Stream(window, relay)
        _RELAY.set(relay)  # NOTE: this task's context: the handler's RequestStream takes it
        try:
            handler = self.handlers.get(kind)
            if handler is None:
                raise ConnectionError(f"this worker takes no {kind!r} over its delta channel")
            await self._stream(conn, attempt, stream, handler(request))
            conn.send(attempt, END)
        except asyncio.CancelledError:
            if not stream.cancelled:
                raise
        except Exception as e:  # noqa: BLE001 - the router raises it where the stream is read
            conn.send(attempt, sendable(e))
        finally:
            conn.streams.pop(attempt, None)

    @staticmethod
    async def _stream(conn: _Connection, attempt: str, stream: _Stream, deltas: AsyncGenerator[Any, None]) -> None:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                conn.send(attempt, to_wire(delta))
                stream.unacked += 1
                if stream.unacked >= stream.window:
                    stream.room.clear()
                    await stream.room.wait()

    def close(self) -> None:
        for conn in list(self._connections.values()):
            conn.close()
        if self._server is not None:
            self._server.close()
