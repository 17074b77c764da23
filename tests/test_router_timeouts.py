"""The router's timeouts on the token path (router/timeouts.py): one `Deadline` per request, not a timer per chunk."""

from __future__ import annotations

import asyncio

import pytest

from router.timeouts import Deadline


def test_waits_before_the_deadline_return_their_values_and_share_one_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadline = Deadline(loop.time() + 30)
        timers = len(loop._scheduled)  # type: ignore[attr-defined]
        for i in range(100):
            assert await deadline.wait(asyncio.sleep(0, i)) == i
        assert len(loop._scheduled) == timers  # type: ignore[attr-defined]  # no timer per wait
        deadline.cancel()

    asyncio.run(main())


def test_a_wait_under_way_at_the_deadline_raises_timeout_and_its_coroutine_is_cancelled() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadline = Deadline(loop.time() + 0.05)
        seen: list[str] = []

        async def slow() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        with pytest.raises(TimeoutError):
            await deadline.wait(slow())
        assert seen == ["cancelled"]
        with pytest.raises(TimeoutError):  # after the deadline: at once
            await deadline.wait(asyncio.sleep(0))
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the task is not left cancelled

    asyncio.run(main())


def test_a_cancel_from_outside_stays_a_cancel() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadline = Deadline(loop.time() + 30)
        task = asyncio.ensure_future(deadline.wait(asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline.cancel()

    asyncio.run(main())
