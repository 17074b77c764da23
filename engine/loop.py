"""EngineLoop: steps an LLMEngine on a background thread; workers hand it requests and get outputs back.

Life of a request on the loop:
1. a caller runs `call(fn)`: `fn(engine)` under the engine lock (add_request, take a transfer, ...), then
   `attach(request_id, sink)` so the request's outputs reach it; the loop wakes up;
2. the loop thread steps the engine while it has unfinished requests; after each step it calls `on_step` and then
   every sink with that request's `RequestOutput`, still under the lock (a sink may abort its request before the
   next step, e.g. a prefill that stops at its first token);
3. a finished output detaches its sink; `abort(request_id)` stops a request (its sink hears "abort"), and
   `release(request_id)` drops one that is done here without telling the sink;
4. a step that fails aborts the running requests (their sinks hear "abort") and the loop goes on; a failed
   tensor-parallel group (`TPGroupError`) cannot step again: `on_fatal` hears it instead (a worker ends its process,
   so its requests fail over as from any dead worker) and the loop stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.parallel.launch import TPGroupError

log = logging.getLogger(__name__)
T = TypeVar("T")
Sink = Callable[[RequestOutput], None]


HANDOVER_MAX_S = 0.02  # the longest the loop pauses between steps for callers waiting on the engine lock


class EngineLoop:
    """One engine, one stepping thread, one lock; callers never step the engine themselves."""

    def __init__(self, engine: LLMEngine, *, name: str = "engine",
                 on_step: Callable[[float], None] | None = None, before_step: Callable[[], object] | None = None,
                 on_idle: Callable[[], None] | None = None, after_outputs: Callable[[], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        # NOTE: on the loop thread, once: a failure no later step can recover from (a TP group with a dead rank).
        # None: such a step is handled as any other failed step
        self._on_fatal = on_fatal
        # NOTE: once the sinks of a step (or of an abort) have their outputs: a consumer that queues them for
        # another thread hands them over there in one go (cluster/outlet.py)
        self._after_outputs = after_outputs
        # NOTE: both on the loop thread: before each step (e.g. cluster/cores.py sets this thread's torch threads)
        # and once each time the loop runs out of work
        self._before_step, self._on_idle = before_step, on_idle
        self.lock = threading.RLock()  # NOTE: the KV receiver takes this same lock to reserve and commit
        self._wake = threading.Condition(self.lock)
        self._sinks: dict[str, Sink] = {}
        self._on_step = on_step
        self._waiting_callers = 0  # callers blocked on the lock: the loop lets them in between steps
        self._count_lock = threading.Lock()
        # NOTE: for code that holds the engine outside `call` (the KV receiver reserves and commits under it): a
        # plain `with lock` can lose the race to the stepping thread for several steps; this waits like `call`.
        self.between_steps = _BetweenSteps(self)
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-loop")
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` between two steps and wake the loop (new work may have arrived)."""
        with self.between_steps:
            result = fn(self.engine)
            self._wake.notify()
            return result

    def try_call(self, fn: Callable[[LLMEngine], object]) -> bool:
        """`call(fn)` if the engine is between steps and no caller waits for it (True), else nothing (False).

        NOTE: for an event loop: a request joins an idle engine without a hop to a thread and back (a thread's wakeup
        is a good part of a millisecond on a busy host, and a first token on a GPU takes a few); where the engine is
        busy the caller goes the way of `call`, from a thread."""
        if self._waiting_callers or not self.lock.acquire(blocking=False):
            return False
        try:
            fn(self.engine)
            self._wake.notify()
        finally:
            self.lock.release()
        return True

    def run_between_steps(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future[object]:
        """From an event loop: `fn(engine)` between two steps; await the future returned.

        At once where the engine is idle (`try_call`: the future is done, and what `fn` raised is raised here), else
        by `call` on a thread (the future is that call's; the call runs to its end even if its waiter is cancelled)."""
        if self.try_call(fn):
            done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return asyncio.ensure_future(asyncio.to_thread(self.call, fn))

    def attach(self, request_id: str, sink: Sink) -> None:
        """Deliver the outputs of `request_id` to `sink` (called on the loop thread, under the lock)."""
        with self.lock:
            self._sinks[request_id] = sink

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it is (its blocks are freed); its sink gets a final "abort" output."""
        def stop(engine: LLMEngine) -> None:
            sink = self._sinks.pop(request_id, None)
            engine.abort_request(request_id)
            if sink is not None:
                sink(RequestOutput(request_id, [], "", True, "abort"))
                self._delivered()
        self.call(stop)

    def release(self, request_id: str) -> None:
        """The request is done here (e.g. a prefill handed on): drop it and its sink without a final output."""
        def drop(engine: LLMEngine) -> None:
            self._sinks.pop(request_id, None)
            engine.abort_request(request_id)
        self.call(drop)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._on_idle is not None and not self.engine.has_unfinished_requests():
                    self._on_idle()
                while not self._closed and not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                if self._closed:
                    return
                started = time.monotonic()
                try:
                    if self._before_step is not None:
                        self._before_step()
                    outputs = self.engine.step()
                except TPGroupError as e:
                    if self._on_fatal is None:
                        log.exception("engine step failed; aborting the running requests")
                        self._abort_all()
                        continue
                    # NOTE: the requests are not aborted: an "abort" would reach the router as the request's end,
                    # where a dead worker's requests fail over to another one
                    log.critical("the tensor-parallel group failed: this engine cannot step again (%s)", e)
                    self._closed = True
                    self._on_fatal(e)
                    return
                except Exception:  # noqa: BLE001 - a failed step must not kill the worker: fail its requests
                    log.exception("engine step failed; aborting the running requests")
                    self._abort_all()
                    continue
                if self._on_step is not None:
                    self._on_step(started)
                for out in outputs:
                    sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
                    if sink is None:
                        continue
                    try:
                        sink(out)
                    except Exception:  # noqa: BLE001 - one broken consumer must not stop the loop for all
                        log.exception("output of %s could not be delivered; aborting it", out.request_id)
                        self._sinks.pop(out.request_id, None)
                        self.engine.abort_request(out.request_id)
                self._delivered()
            # NOTE: Python locks are not fair: without a pause the loop could take the lock again before a waiting
            # caller wakes, for many steps. Pause until those waiting now are in (bounded: new ones may keep coming).
            deadline = time.monotonic() + HANDOVER_MAX_S
            while self._waiting_callers > 0 and time.monotonic() < deadline:
                time.sleep(0.0002)

    def _abort_all(self) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort_request(rid)
            sink(RequestOutput(rid, [], "", True, "abort"))
        self._sinks.clear()
        self._delivered()

    def _delivered(self) -> None:
        if self._after_outputs is not None:
            self._after_outputs()


class _BetweenSteps:
    """The engine lock as a context manager that the loop hands over between two steps (reusable, reentrant)."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop

    def __enter__(self) -> _BetweenSteps:
        loop = self._loop
        with loop._count_lock:
            loop._waiting_callers += 1
        loop.lock.acquire()
        with loop._count_lock:
            loop._waiting_callers -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.lock.release()
