"""`within(awaitable, timeout)`: wait for it in the current task, TimeoutError after `timeout` seconds.

NOTE: `asyncio.wait_for` of a coroutine runs it in a new Task (before Python 3.12): on the path every token takes
that was a Task per token per stream. `asyncio.timeout` (3.11+) only schedules one timer in the caller's task;
its cancellation reaches the awaited generator chain as wait_for's did.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], timeout: float) -> T:
        async with asyncio.timeout(timeout):
            return await aw
else:  # pragma: no cover - Python 3.10
    async def within(aw: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(aw, timeout)
