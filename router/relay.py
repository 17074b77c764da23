"""A bounded buffer between a request's run and its client: backpressure, and a limit on a client that stops reading.

1. a task of its own (the pump) moves the run's chunks into a buffer of at most `limit` chunks;
2. the front takes them and writes each to its client (chunks that piled up while it wrote, one after another, as
   one: `join`, the cost of a write is per message, so a front that falls behind catches up in fewer, larger
   messages instead of falling further behind); with `every` > 1 (`router.stream_interval`) the front waits until
   the buffered chunks carry `every` tokens (the first chunk goes at once; the rest when the run ends or the
   buffer is full) and writes them as one; while the buffer is full the pump waits, so
   the run stops reading the decode worker's stream, whose window (router/flow.py: Ray's generator backpressure)
   then pauses the worker's yields: a client that reads slowly piles nothing up in the router;
3. a buffer that stays full for `stall_s` (the client took nothing meanwhile: its writes are blocked) ends the run
   with ClientStalled: the run is closed (its `finally` aborts the request on every worker, freeing the KV blocks,
   and the router's admission slot), and the front's write that waits for the client is ended: by `on_cut` when
   the front gives one (gRPC: the call ends at once with a status naming the limit), else by cancelling the
   front's task (HTTP: the connection is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from router.errors import ClientStalled

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextlib.contextmanager
def ending_with_front(tasks: list[asyncio.Task[Any]]) -> Iterator[None]:
    """While open, the front's task ending cancels `tasks` (a stream's pumps).

    NOTE: a front whose task ends with its generator left open (suspended at its yield: gRPC's generator handlers
    were) would keep the run, its lease and its KV blocks until a garbage collection: the pumps, whose close closes
    the run, go with the front's task. `tasks` is read when the front ends (pumps started later count)."""
    owner = asyncio.current_task()
    gone = lambda _: [t.cancel() for t in tasks]  # noqa: E731
    if owner is not None:
        owner.add_done_callback(gone)
    try:
        yield
    finally:
        if owner is not None:
            owner.remove_done_callback(gone)


class Relay:
    """The pump's and the front's shared state: the buffered chunks and how the run ended."""

    def __init__(self, limit: int, on_size: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.on_size = on_size  # told each change of the buffer's size (+1, -1): the router's gauge
        self.buffer: deque[object] = deque()
        self.readable, self.writable = asyncio.Event(), asyncio.Event()
        self.ended = False
        self.closed = False  # the front went away: the pump stops at its next put
        self.error: BaseException | None = None
        self.high_water = 0  # the most chunks buffered at once (tests and logs)
        self.taken = 0  # chunks the front took so far

    async def put(self, item: object, stall_s: float, request_id: str) -> None:
        """Buffer `item`, waiting while the buffer is full; ClientStalled after `stall_s` without room."""
        while len(self.buffer) >= self.limit and not self.closed:
            self.writable.clear()
            try:
                await asyncio.wait_for(self.writable.wait(), stall_s)
            except TimeoutError:
                raise ClientStalled(f"the client read nothing for {stall_s:.0f} s with {len(self.buffer)} chunks "
                                    "waiting (router.client_stall_timeout_s)", request_id) from None
        if self.closed:  # NOTE: a pump that missed its cancel (see `relayed`) stops here all the same
            raise asyncio.CancelledError
        self.buffer.append(item)
        self.high_water = max(self.high_water, len(self.buffer))
        self._sized(1)
        self.readable.set()

    def ready(self, every: int) -> bool:
        """Whether the front takes the buffer now: it holds chunks, and `every` tokens of them, or the first chunk, or
        it is full, or the run ended."""
        if not self.buffer:
            return False
        return every <= 1 or not self.taken or self.ended or len(self.buffer) >= self.limit \
            or sum(len(getattr(c, "token_ids", ())) or 1 for c in self.buffer) >= every

    def take(self, join: Callable[[Any, Any], Any] | None = None) -> object:
        """The next chunk, with the ones after it that `join(a, b)` makes one (None: they stay apart)."""
        item, taken = self.buffer.popleft(), 1
        while join is not None and self.buffer:
            joined = join(item, self.buffer[0])
            if joined is None:
                break
            item, taken = joined, taken + 1
            self.buffer.popleft()
        self._sized(-taken)
        self.taken += taken
        self.writable.set()
        return item

    def drop(self) -> None:
        """Forget what is left (the front went away)."""
        self._sized(-len(self.buffer))
        self.buffer.clear()

    def _sized(self, change: int) -> None:
        if self.on_size is not None and change:
            self.on_size(change)

    def end(self, error: BaseException | None) -> None:
        self.ended, self.error = True, error
        self.readable.set()


async def relayed(chunks: AsyncGenerator[T, None], limit: int, stall_s: float, request_id: str = "",
                  on_size: Callable[[int], None] | None = None,
                  on_stall: Callable[[], None] | None = None,
                  on_cut: Callable[[ClientStalled], Awaitable[None]] | None = None,
                  join: Callable[[T, T], T | None] | None = None, every: int = 1) -> AsyncGenerator[T, None]:
    """`chunks` through a buffer of `limit`; closing this closes `chunks` (at once: the request is aborted).
    `join`: two buffered chunks as one, or None; `every`: the tokens a take waits for (see the module's NOTE)."""
    relay = Relay(limit, on_size)
    owner = asyncio.current_task()
    writing = [False]  # the front holds a chunk it has not written yet (its task waits on the client)

    async def pump() -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await relay.put(chunk, stall_s, request_id)
            relay.end(None)
        except asyncio.CancelledError:
            relay.end(asyncio.CancelledError())
            raise
        except Exception as e:  # noqa: BLE001 - handed to the front, which maps it to a status
            relay.end(e)
            if isinstance(e, ClientStalled):
                log.warning("%s", e)
                if on_stall is not None:
                    on_stall()
                if writing[0] and on_cut is not None:  # NOTE: its write would wait for the client forever
                    await on_cut(e)
                elif writing[0] and owner is not None:
                    owner.cancel()

    task = asyncio.create_task(pump())
    with ending_with_front([task]):
        try:
            while True:
                while not relay.ready(every) and not relay.ended:
                    relay.readable.clear()
                    await relay.readable.wait()
                if relay.buffer:
                    item = relay.take(join)
                    writing[0] = True
                    yield item  # type: ignore[misc]
                    writing[0] = False
                    continue
                if relay.error is not None:
                    raise relay.error
                return
        finally:
            # NOTE: the flag as well as the cancel: a cancel can be lost (asyncio.wait_for before Python 3.12 returns
            # a result that came in with the cancel), and such a pump went on reading the run into a buffer nobody
            # reads, until the client-stall cut, its sequence paused on the worker meanwhile; it stops at its next put
            relay.closed = True
            if not task.done():
                task.cancel()
            try:
                await asyncio.wait([task])  # NOTE: the run's abort has been sent when this returns
            finally:
                # NOTE: even when the wait is cut short: gRPC cancels a call's task when the client's cancel reaches it,
                # also after the failed write that closes this; the pump, cancelled already, ends on its own
                relay.drop()
