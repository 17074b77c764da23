"""A decode stream's waits for its next delta (router/streams.py: `ChannelStream.next`) time out as asked.

The stream keeps one timer and moves it lazily (no timer made and cancelled per token): these check that each wait
still ends at its own deadline whether the timer left by an earlier wait is earlier or later than it, and that a
delta arriving in time is returned. The channel here only records what the stream sends it (the stream's logic is
under test; tests/test_decode_handoff.py and the fault tests run it over real workers).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.delta_wire import END
from cluster.messages import Delta
from router.streams import ChannelStream


class RecordingChannel:
    """What a stream needs of its worker's delta channel: open, ack and cancel frames, here recorded."""

    connected = True

    def __init__(self) -> None:
        self.streams: dict[str, Any] = {}
        self.sent: list[tuple[str, ...]] = []

    def open(self, stream: ChannelStream, request: Any, window: int) -> None:
        self.sent.append(("open", stream.attempt))

    def ack(self, attempt: str, n: int) -> None:
        self.sent.append(("ack", attempt))

    def cancel(self, attempt: str) -> None:
        self.sent.append(("cancel", attempt))


def opened() -> tuple[ChannelStream, RecordingChannel]:
    channel = RecordingChannel()
    worker = SimpleNamespace(channel=channel, actor=None)
    return ChannelStream(worker, "generate", "r~1", request=None, window=16, through_ray=lambda: None), channel


def delta(token: int) -> Delta:
    return Delta([token], f" t{token}")


async def timed_out_after(stream: ChannelStream, timeout: float) -> float:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await stream.next(timeout)
    return time.monotonic() - started


def test_each_wait_ends_at_its_own_deadline() -> None:
    async def main() -> None:
        stream, channel = opened()
        assert channel.sent == [("open", "r~1")] and channel.streams["r~1"] is stream

        # a delta that comes in time is returned
        asyncio.get_running_loop().call_later(0.02, stream.put, delta(1))
        assert (await stream.next(5.0)).token_ids == [1]
        # the long wait's timer is still set (for 5 s from then): a shorter wait must not outlive its own deadline
        assert await timed_out_after(stream, 0.05) < 2.0
        # a wait after one that timed out: its delta, not the earlier timeout
        asyncio.get_running_loop().call_later(0.05, stream.put, delta(2))
        assert (await stream.next(1.0)).token_ids == [2]
        # a timer set for an earlier wait (0.1 s) fires before this one's deadline: it waits on, the delta comes
        asyncio.get_running_loop().call_later(0.01, stream.put, delta(3))
        assert (await stream.next(0.1)).token_ids == [3]
        asyncio.get_running_loop().call_later(0.25, stream.put, delta(4))
        assert (await stream.next(2.0)).token_ids == [4]
        # the end of the stream, then no timer is left behind
        stream.put(END)
        with pytest.raises(StopAsyncIteration):
            await stream.next(1.0)
        assert stream._timer is None and "r~1" not in channel.streams

    asyncio.run(main())


def test_a_closed_stream_is_cancelled_on_its_worker_and_leaves_no_timer() -> None:
    async def main() -> None:
        stream, channel = opened()
        await timed_out_after(stream, 0.01)
        asyncio.get_running_loop().call_later(0.02, stream.put, delta(1))
        assert (await stream.next(5.0)).token_ids == [1]
        stream.close()
        assert channel.sent[-1] == ("cancel", "r~1") and stream._timer is None and not channel.streams

    asyncio.run(main())
