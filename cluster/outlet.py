"""Outlet: a worker's engine thread hands its step's outputs on once per step: to the actor's event loop with one
wakeup, and onto the delta channel's connections with one frame each (cluster/frame_writer.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Outlet:
    """The engine thread's outputs into one event loop, one wakeup per step for all of its streams.

    NOTE: a `call_soon_threadsafe` per stream per step wrote the loop's self-pipe once per token: at 32 streams of
    a fast model that was a tenth of the decode worker's CPU, and the event loop woke (and sent a frame to each
    router) several times per step. Outputs are queued here (`put`); the engine loop calls `flush` once the step's
    sinks all ran (engine/loop.py `after_outputs`), and one call hands the loop everything queued.
    """

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable[[Any], None], Any]] = []
        self._scheduled = False
        self._sends: set[Callable[[], None]] = set()  # the engine thread's own: connections to flush after the step

    def put(self, fn: Callable[[Any], None], arg: Any) -> None:
        """(the engine thread, in a sink) `fn(arg)` on the loop, at the next `flush`."""
        with self._lock:
            self._queued.append((fn, arg))

    def send_after_step(self, flush: Callable[[], None]) -> None:
        """(the engine thread, in a sink) call `flush` (a connection's) once this step's sinks have all run."""
        self._sends.add(flush)

    def flush(self) -> None:
        """(the engine thread, after the sinks) send the connections' frames, then hand over what was queued: one
        wakeup of the loop."""
        if self._sends:
            sends, self._sends = self._sends, set()
            for send in sends:
                send()
        with self._lock:
            if self._scheduled or not self._queued:
                return
            self._scheduled = True
        try:
            self.aio.call_soon_threadsafe(self._drain)
        except RuntimeError:  # NOTE: the loop closed (the actor is going away): nobody waits for these
            with self._lock:
                self._queued.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
            self._scheduled = False
        for fn, arg in queued:
            fn(arg)
