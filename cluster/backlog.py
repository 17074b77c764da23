"""A stream's undelivered outputs: when its sequence pauses in the engine, when it resumes, and its busy clock.

1. each engine step's output for the stream counts as undelivered until the stream's consumer takes the delta
   that carries it (the router, through Ray's generator window: a client that stops reading blocks the yield);
2. once `window` outputs are undelivered the sequence is paused in the engine (not scheduled, its KV blocks kept):
   a client that stops reading costs no decode steps, and the tokens made for it stay bounded near the window;
3. when the consumer takes a delta again and fewer than `window` are left undelivered, the sequence resumes;
4. outputs are stamped on a clock that stops while the stream is paused: the router's stall clock
   (router/stall.py) measures the worker's time per token, never the time its client did not read.
"""

from __future__ import annotations

import threading
import time


class Backlog:
    """Outputs made for one stream and not yet taken by its consumer (the engine thread and the event loop share it)."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.undelivered = 0
        self.paused = False
        self._lock = threading.Lock()
        self._paused_at = 0.0
        self._paused_s = 0.0  # total time paused so far

    def made(self) -> tuple[float, bool]:
        """One more output (the engine thread): its stamp on the busy clock, and whether to pause the sequence now."""
        with self._lock:
            now = time.monotonic()
            self.undelivered += 1
            if self.paused or self.undelivered < self.window:
                return now - self._paused_s, False
            self.paused, self._paused_at = True, now
            return now - self._paused_s, True

    def delivered(self, n: int) -> bool:
        """The consumer took a delta of `n` outputs; whether to resume the sequence now."""
        with self._lock:
            self.undelivered -= n
            if not self.paused or self.undelivered >= self.window:
                return False
            self.paused = False
            self._paused_s += time.monotonic() - self._paused_at
            return True
