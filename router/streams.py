"""A request's delta stream from one worker, as a run reads it: over the worker's delta channel, or Ray's generator.

1. `open_stream(worker, request, window)` returns at once (the run opens the handoff's stream together with its
   prefill): over a connected delta channel (router/delta_channel.py) the open frame leaves at once; otherwise a
   task connects this router to the worker's channel first, and a worker that offers no channel (a KV plane with
   TLS) streams through a Ray streaming generator instead, as every worker did before;
2. `next(timeout)` is the next Delta (StopAsyncIteration after the last one); a failed worker raises here: its Ray
   call's error, its channel closing (the process died), or the exception its generator ended with;
3. each delta taken is acknowledged to the worker (batched: one frame per round of the event loop for all the
   channel's streams), which keeps at most `window` unacknowledged: a client that reads slowly pauses the worker's
   stream, as Ray's generator window did;
4. `close()` before the end cancels the stream on the worker (its request is aborted there, its blocks freed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.delta_wire import END
from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult
from router.delta_channel import DeltaChannel
from router.timeouts import within

log = logging.getLogger(__name__)


class DeltaStream(Protocol):
    async def next(self, timeout: float) -> Delta: ...

    def fail(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


class RayStream:
    """A Ray streaming generator of Deltas (one Ray object per delta, `window` unread at most)."""

    def __init__(self, actor: Any, request: DecodeRequest, window: int) -> None:
        self._gen = actor.generate.options(num_returns="streaming",
                                           _generator_backpressure_num_objects=window).remote(request)

    async def next(self, timeout: float) -> Delta:
        ref = await within(anext(self._gen), timeout)
        return await ref  # type: ignore[no-any-return]

    def fail(self, error: BaseException) -> None:
        pass  # NOTE: only a channel's prefill results come before the hand-off; a Ray one comes after it

    def close(self) -> None:
        pass


class ChannelStream:
    """One stream over a worker's delta channel (or, where the worker has none, its Ray generator)."""

    def __init__(self, worker: Any, kind: str, attempt: str, request: Any, window: int,
                 through_ray: Callable[[], Any]) -> None:
        self.attempt, self.kind = attempt, kind
        self.channel: DeltaChannel = worker.channel
        # NOTE: a stream's deltas are acknowledged (the worker holds at most `window` unacknowledged); a call's not
        self.ack_every = max(1, window // 2) if kind == "generate" else 0
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # fails a wait that outlives `_wait_until` (see `next`)
        self._wait_until = 0.0
        self._untold = 0  # deltas taken and not yet acknowledged
        self._ended = False
        self._ray: Any = None  # the Ray stream or call, where the worker has no channel
        self._opened = False
        if self.channel.connected:  # NOTE: the usual case: the open frame leaves now, not a round of the loop later
            self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._started.set_result(None)
            self._open(request, window)
        else:
            self._started = asyncio.ensure_future(self._start(worker.actor, request, window, through_ray))

    async def _start(self, actor: Any, request: Any, window: int, through_ray: Callable[[], Any]) -> None:
        if not await self.channel.connect(actor):
            self._ray = through_ray()
            return
        self._open(request, window)

    def _open(self, request: Any, window: int) -> None:
        self.channel.streams[self.attempt] = self
        self.channel.open(self, request, window)
        self._opened = True

    def put(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float) -> Delta:
        if not self._started.done():
            await within(asyncio.shield(self._started), timeout)
        self._started.result()  # NOTE: raises what the start raised (the worker died before it answered)
        if self._ray is not None:
            return await self._ray.next(timeout)
        if self._ended:
            raise StopAsyncIteration
        if not self._items:
            # NOTE: a future of ours and one timer per stream that fails it (no asyncio.timeout per token), moved
            # lazily: each wait sets its deadline, and a timer that fires before it (an earlier wait's) waits on to
            # it; a timer is made again only when none is left or the new deadline is the earlier one
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            self._wait_until = loop.time() + timeout
            if self._timer is None or self._timer.when() > self._wait_until:
                self._stop_timer()
                self._timer = loop.call_at(self._wait_until, self._timed_out)
            try:
                await waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item == END:
            self._end()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        self._untold += 1
        if self.ack_every and self._untold >= self.ack_every:
            self.channel.ack(self.attempt, self._untold)
            self._untold = 0
        if isinstance(item, Delta) and item.finished:
            self._end()
        return item  # type: ignore[return-value]

    async def item(self, timeout: float) -> Any:
        """The next item of a call (Ray's one result where the worker has no channel)."""
        if not self._started.done():
            await within(asyncio.shield(self._started), timeout)
        self._started.result()
        if self._ray is not None:
            ray, self._ray = self._ray, None
            self._ended = True
            return await within(ray, timeout)
        return await self.next(timeout)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` where it is read (its worker is known to have failed it)."""
        if self._ray is None:
            self.put(error)

    def _timed_out(self) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # NOTE: nothing waits now: the next wait makes a timer again
        loop = asyncio.get_running_loop()
        if loop.time() < self._wait_until:  # NOTE: a later wait's deadline
            self._timer = loop.call_at(self._wait_until, self._timed_out)
        else:
            self._waiter.set_exception(TimeoutError())

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end(self) -> None:
        self._ended = True
        self._stop_timer()
        self.channel.streams.pop(self.attempt, None)

    def close(self, ended: bool = False) -> None:
        """Let the stream go: a stream that has not ended is cancelled on the worker (its request aborted);
        `ended`: the caller took all it wanted of a call that ends by itself."""
        self._ended = self._ended or ended
        if not self._started.done():
            self._started.cancel()
        elif self._started.cancelled() or self._started.exception() is not None:
            pass  # NOTE: exception() marks it retrieved: no "never retrieved" warning
        elif not self._ended and self._opened:
            self.channel.cancel(self.attempt)
        self._end()


def _has_channel(worker: Any) -> bool:
    return worker.channel.available is not False and hasattr(worker.actor, "stream_endpoint")


def open_stream(worker: Any, request: DecodeRequest, window: int) -> DeltaStream:
    """`request`'s deltas from `worker` (a router.pools.WorkerHandle): its delta channel, else its Ray generator."""
    if not _has_channel(worker):
        return RayStream(worker.actor, request, window)
    return ChannelStream(worker, "generate", request.request_id, request, window,
                         lambda: RayStream(worker.actor, request, window))


class PrefillCall:
    """A prefill worker's answer to one request: the first token as soon as it is sampled (over the delta channel;
    the KV still moving), then the hand-off's final result; through Ray (no channel) one result after the hand-off.
    """

    def __init__(self, worker: Any, request: PrefillRequest) -> None:
        self._ref: Any = None
        self._call: ChannelStream | None = None
        if _has_channel(worker):
            # NOTE: window 2: the worker sends both results without waiting for an acknowledgement
            self._call = ChannelStream(worker, "prefill", request.request_id, request, 2,
                                       lambda: worker.actor.prefill.remote(request))
        else:
            self._ref = worker.actor.prefill.remote(request)

    async def first(self, timeout: float) -> PrefillResult:
        if self._call is None:
            return await within(self._ref, timeout)  # type: ignore[no-any-return]
        return await self._call.item(timeout)  # type: ignore[no-any-return]

    async def final(self, timeout: float) -> PrefillResult:
        """The result after the hand-off (after a first one with `handed_off` False); raises what failed it."""
        assert self._call is not None
        result = await self._call.item(timeout)
        self._call.close(ended=True)  # NOTE: its END follows: nothing to cancel on the worker
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        """Let the call go: one not finished is cancelled on the worker (its request and transfer aborted)."""
        if self._call is not None:
            self._call.close()


@dataclass
class OpenStream:
    """A decode stream the run opened: its worker, its deltas, the attempt's span."""

    worker: Any  # router.pools.WorkerHandle
    attempt_id: str
    stream: DeltaStream
    span: Any
    handoff: bool  # takes a transferred KV (the worker works out the first token's characters itself)
