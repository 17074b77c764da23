"""FrameWriter: one delta-channel connection's outgoing frames, written from the event loop or the engine thread.

NOTE: why the engine thread writes: a decode worker's deltas used to go engine thread -> event loop (a wakeup, a
queue per stream, an async generator resumed per token, the frame built there) -> socket. At a fast step that hop
was most of the worker's time beyond the step, and it ran under the GIL the engine thread needs. Now the engine
thread appends each output to the connection's list (`put`) and, once the step's outputs are all in, frames and
sends them (`flush`) itself: one pickle and one non-blocking `send` per step and router, as vLLM's engine core
sends one message of all outputs per step.
1. items from any thread go into one list under one lock, so a stream's items keep their order whoever adds them
   (the engine thread's deltas, then the event loop's END);
2. `flush` takes the list, frames it and sends it on the connection's own (duplicated) socket, never blocking: what
   the socket does not take now waits in `_pending` and the event loop sends it when the socket is writable (a
   router that reads slowly never stalls the engine; the acknowledgement window bounds what can pile up);
3. a failed send marks the writer closed; the reader side sees the same connection drop and ends its streams.
The asyncio transport of the connection only reads; every write goes through here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from cluster.delta_wire import frame


class FrameWriter:
    """The outgoing side of one connection (thread-safe; `aio` is the event loop that owns the connection)."""

    def __init__(self, sock: socket.socket, aio: asyncio.AbstractEventLoop) -> None:
        # NOTE: a duplicate of the transport's socket: the same connection, its own descriptor, so the event loop can
        # watch it for writability without touching the transport's registration (which only reads)
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.setblocking(False)
        self._aio = aio
        self._lock = threading.Lock()
        self._items: list[tuple[str, object]] = []
        self._pending = bytearray()  # framed bytes the socket has not taken yet
        self.closed = False

    def put(self, attempt: str, item: object) -> bool:
        """Queue `item` of stream `attempt` for the next frame; True if it is the first since the last flush."""
        with self._lock:
            if self.closed:
                return False
            self._items.append((attempt, item))
            return len(self._items) == 1

    def flush(self) -> None:
        """Frame what was queued and send it (what the socket does not take now goes when it can)."""
        with self._lock:
            if not self._items or self.closed:
                return
            items, self._items = self._items, []
            self._send(frame(("deltas", items)))

    def write(self, data: bytes) -> None:
        """Send bytes already framed (the welcome), after anything still pending."""
        with self._lock:
            if not self.closed:
                self._send(data)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._items.clear()
            self._pending.clear()
        try:
            self._aio.call_soon_threadsafe(self._unwatch)
        except RuntimeError:  # NOTE: the loop is closed: nothing watches the socket any more
            self._sock.close()

    def _send(self, data: bytes) -> None:  # under the lock
        if self._pending:  # NOTE: behind bytes the socket has not taken: they go first, in order
            self._pending += data
            return
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.closed = True
            return
        if sent < len(data):
            self._pending += data[sent:]
            self._aio.call_soon_threadsafe(self._watch)

    def _watch(self) -> None:  # the event loop
        if not self.closed:
            self._aio.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:  # the event loop: the socket takes more
        with self._lock:
            if self.closed:
                return  # NOTE: close() unwatches it
            try:
                del self._pending[:self._sock.send(self._pending)]
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                self._pending.clear()
            done = not self._pending
        if done:
            self._aio.remove_writer(self._sock.fileno())

    def _unwatch(self) -> None:  # the event loop
        if self._sock.fileno() >= 0:
            self._aio.remove_writer(self._sock.fileno())
            self._sock.close()
