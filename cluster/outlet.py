"""Outlet: a worker's engine thread hands its step's outputs to the actor's event loop with one wakeup per step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Outlet:
    """The engine thread's outputs into one event loop, one wakeup per step for all of its streams.

    NOTE: a `call_soon_threadsafe` per stream per step wrote the loop's self-pipe once per token: at 32 streams of
    a fast model that was a tenth of the decode worker's CPU. Here the first output of a step schedules the one
    call that hands over everything queued until it runs.
    """

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable[[Any], None], Any]] = []

    def put(self, fn: Callable[[Any], None], arg: Any) -> None:
        """(any thread) `fn(arg)` on the loop, soon."""
        with self._lock:
            self._queued.append((fn, arg))
            if len(self._queued) > 1:
                return
        self.aio.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
        for fn, arg in queued:
            fn(arg)
