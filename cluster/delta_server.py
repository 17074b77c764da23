"""DeltaServer: a worker's one connection per router that carries every stream's deltas, each step's as one message.

NOTE: as vLLM's engine core sends one message of all requests' outputs per step (ZMQ) and SGLang's scheduler one
per batch to its detokenizer, the cost of the path then scales with steps, not with tokens × streams: a Ray
streaming generator per request made one Ray object per delta, each read by the router's core worker.
Life of a connection and of the streams on it:
1. a router asks the worker (through Ray, which authenticates it) for `endpoint()`: an address and a secret; it
   connects, sends `("hello", secret, channel)` and waits for `("welcome",)`; the connection is now channel
   `channel` (the router's id) on this worker;
2. the router opens a request's stream with `("open", attempt, "generate", request, window)`: the worker's delta
   generator (cluster/request_stream.py) runs and each delta is queued for the connection; a call (`"prefill"`:
   the prefill worker's first token) sends its one result the same way. Every item queued while the event loop
   ran one round (a step's outputs for all its streams) leaves as one frame `("deltas", [(attempt, item), ...])`,
   where the item is a Delta (most as a tuple: `to_wire`), a call's result, END (the generator returned) or the
   exception that ended it; no Ray call is made per request (Ray's round trip was ~5 ms of a first token here);
3. backpressure as Ray's generator window had it: with `window` deltas of a stream not yet acknowledged (the
   router acknowledges as its client takes them: `("ack", {attempt: n})`) `serve` waits before reading the next
   one, and the stream's sequence pauses in the engine (cluster/backlog.py);
4. a router that cancels a stream (`("cancel", [attempt])`: its client went away) or whose connection drops (the
   router died) ends its streams here: the generators close, which aborts their requests and frees their blocks.
Frames are a 4-byte big-endian length and a pickle: both ends are this project's processes, and a peer is admitted
only with the secret that Ray handed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cluster.messages import Delta

log = logging.getLogger(__name__)

END = "end"  # the item after a stream's last delta: its generator returned
HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
HELLO_TIMEOUT_S = 10.0


async def read_bytes(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """The next frame's bytes; IncompleteReadError when the peer closed the connection."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise ConnectionError(f"a frame of {size} bytes")
    return await reader.readexactly(size)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object (only from a peer that proved the secret: a pickle runs code)."""
    return pickle.loads(await read_bytes(reader))


def frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def hello(secret: str, channel: str) -> bytes:
    """The router's first frame: plain bytes, read before anything is unpickled."""
    data = f"hello {secret} {channel}".encode()
    return HEADER.pack(len(data)) + data


def to_wire(delta: object) -> object:
    """A delta as it goes on the channel: most carry only new tokens, as a tuple (a third of a Delta's pickle time)."""
    d = delta
    if type(d) is not Delta:  # NOTE: a call's result
        return d
    if (d.finished or d.logprobs or d.prompt_logprobs is not None or d.resumed_chars or d.queue_ms or d.prefill_ms
            or d.finish_reason or d.final_text or d.all_token_ids):
        return d
    return (d.token_ids, d.text, d.made_at, d.num_prompt_tokens, d.num_cached_tokens)


def from_wire(item: object) -> object:
    """The Delta of a `to_wire` tuple; anything else (a whole Delta, END, an exception) as it is."""
    if type(item) is tuple:
        ids, text, made_at, prompt, cached = item
        return Delta(ids, text, made_at=made_at, num_prompt_tokens=prompt, num_cached_tokens=cached)
    return item


def sendable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its text when it does not survive a pickle round trip."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may come out of a generator
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Stream:
    """One stream on a connection: its unacknowledged deltas and the task that serves it."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.unacked = 0
        self.room = asyncio.Event()
        self.room.set()
        self.task = asyncio.current_task()
        self.cancelled = False

    def acked(self, n: int) -> None:
        self.unacked -= n
        if self.unacked < self.window:
            self.room.set()

    def cancel(self) -> None:
        if not self.cancelled and self.task is not None:
            self.cancelled = True
            self.task.cancel()


class _Connection:
    """One router's connection: its streams and the frame being gathered for it."""

    def __init__(self, channel: str, writer: asyncio.StreamWriter) -> None:
        self.channel, self.writer = channel, writer
        self.streams: dict[str, _Stream] = {}
        self.outbox: list[tuple[str, object]] = []
        self.closed = False

    def send(self, attempt: str, item: object) -> None:
        if self.closed:
            return
        if not self.outbox:  # NOTE: the first item of this round: the frame leaves once the round is over
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox.append((attempt, item))

    def _flush(self) -> None:
        items, self.outbox = self.outbox, []
        if items and not self.closed:
            self.writer.write(frame(("deltas", items)))

    def close(self) -> None:
        self.closed = True
        for stream in list(self.streams.values()):
            stream.cancel()
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
        writer.write(frame(("welcome",)))
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
        stream = conn.streams[attempt] = _Stream(window)
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
