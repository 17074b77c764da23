"""Timeouts on the path every token takes: `within(awaitable, timeout)` for one wait, `Deadline` for many, `until`
for a stream's items.

NOTE: `asyncio.wait_for` of a coroutine runs it in a new Task (before Python 3.12): on the path every token takes
that was a Task per token per stream. `asyncio.timeout` (3.11+) only schedules one timer in the caller's task;
its cancellation reaches the awaited generator chain as wait_for's did. A request's deadline is one `Deadline`:
one timer for the whole request instead of one scheduled and cancelled per chunk (at 32 streams of a fast model
the per-chunk timers were the largest single cost of the router's event loop).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], timeout: float) -> T:
        async with asyncio.timeout(timeout):
            return await aw
else:  # pragma: no cover - Python 3.10
    async def within(aw: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(aw, timeout)


class Deadline:
    """One deadline (the event loop's clock) for every `wait` of one task: TimeoutError once it has passed.

    One timer fires at the deadline: a task waiting in `wait` then is cancelled there and the wait raises
    TimeoutError (the awaited generator chain sees the cancellation, as under `asyncio.timeout`); a wait that
    starts after it raises at once."""

    def __init__(self, when: float) -> None:
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelled_task = False
        self._handle = asyncio.get_running_loop().call_at(when, self._fire)

    async def wait(self, aw: Awaitable[T]) -> T:
        if self.expired:
            if asyncio.iscoroutine(aw):
                aw.close()  # NOTE: never awaited: closed, not left to warn
            raise TimeoutError
        self._task = asyncio.current_task()
        try:
            return await aw
        except asyncio.CancelledError:
            if not self._cancelled_task:
                raise
            self._cancelled_task = False
            uncancel = getattr(self._task, "uncancel", None)  # NOTE: 3.11+; 3.10 counts no cancellations
            if uncancel is not None and uncancel() > 0:
                raise  # NOTE: cancelled by someone else as well: that cancellation wins
            raise TimeoutError from None
        finally:
            self._task = None

    def cancel(self) -> None:
        """The task is done with it: the timer goes."""
        self._handle.cancel()

    def _fire(self) -> None:
        self.expired = True
        if self._task is not None:
            self._cancelled_task = True
            self._task.cancel()


async def until(items: AsyncGenerator[T, None], when: float) -> AsyncGenerator[T, None]:
    """The items of `items` until `when` (the event loop's clock), then TimeoutError; closing this closes `items`."""
    deadline = Deadline(when)
    try:
        while True:
            try:
                item = await deadline.wait(anext(items))
            except StopAsyncIteration:
                return
            yield item
    finally:
        deadline.cancel()
        await items.aclose()
