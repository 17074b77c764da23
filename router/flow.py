"""One request's way through the pools, with failover: the part of the router that talks to the workers.

Life of a request run (`RequestRun.chunks`), stage by stage:
1. `prefill_with_failover`: the chosen prefill worker computes the prompt and ships the KV to the chosen decode
   worker, whose stream is opened at the same time with the sampling params (`_open_handoff`): it starts decoding
   the moment the KV lands, while the router streams the prefill worker's token (`first_token`). If the prefill
   worker dies, times out or the transfer fails, the run tries another prefill worker (and, if the transfer
   failed, another decode worker); with none left, a decode worker runs the whole request itself;
2. `decode_with_failover`: the router relays the decode worker's stream. If the worker dies mid-stream, or sends
   no token within the stall timeout (router/stall.py: a hung engine), it is marked failed for routing and the
   run continues on another decode worker (or on the same one once Ray restarted it: the run waits for it until
   the request's deadline) with the prompt plus every token already streamed (`continuation`): the client sees no
   token lost or repeated, and a greedy request ends with the same text as an undisturbed run;
3. the last chunk (router/run_chunks.py) carries the finish reason, usage and timeline; a run that does not finish
   aborts the request on every worker it touched, freeing its KV blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator

from cluster import tracing
from cluster.messages import DecodeRequest, PrefillRequest, PrefillResult
from engine.errors import InvalidRequestError
from kv_transfer.state import TransferError
from router.errors import WorkerFailed, unwrap
from router.handoff import HandOff
from router.metrics import RouterMetrics
from router.policy import Route
from router.pools import WorkerHandle, WorkerPools
from router.results import Chunk, Timeline
from router.run_chunks import chunk_of, first_chunk
from router.stall import StallClock, Stalled, wait_alive
from router.streamed_text import StreamedText
from router.streams import OpenStream, PrefillCall, open_stream
from router.validate import Checked

log = logging.getLogger(__name__)
MAX_FAILOVERS = 3  # per phase


def can_fail_over(exc: BaseException) -> bool:
    """Whether another worker may succeed where this one failed (not for bad input or a cancelled client)."""
    return not isinstance(unwrap(exc), InvalidRequestError)


class RequestRun:
    """The state of one request across workers: what was streamed, where, and when."""

    def __init__(self, request: Checked, route: Route, arrived: float, pools: WorkerPools, *,
                 metrics: RouterMetrics, prefill_timeout_s: float, traceparent: str = "",
                 deadline: float | None = None, stall: StallClock | None = None, stream_window: int = 16,
                 stream_interval: int = 1) -> None:
        self.request, self.arrived, self.pools, self.metrics = request, arrived, pools, metrics
        self.traceparent = traceparent  # the router's request span: each attempt's span is its child
        self.prefill_timeout_s = prefill_timeout_s
        # monotonic: the request fails then (the router passes its deadline; a run on its own gets 10 minutes)
        self.deadline = deadline if deadline is not None else time.monotonic() + 600.0
        self.stall = stall or StallClock()
        self.stream_window = stream_window  # unread deltas at most per decode stream: then the worker's yield waits
        self.stream_interval = stream_interval  # tokens per delta of a decode stream (the first and last: fewer)
        self.handoff: OpenStream | None = None  # the decode stream opened with the current prefill attempt
        self.handing_off: HandOff | None = None  # the prefill call's rest, after a first token sent before the KV
        self.request_id, self.prompt_len = request.request_id, len(request.token_ids)
        self.decode_worker = pools[route.decode]
        self.prefill_worker = pools[route.prefill] if route.prefill else None
        self.timeline = Timeline(decode_worker=self.decode_worker.name, prefill_skipped=self.prefill_worker is None)
        self.text = StreamedText(request.request_id)
        self.generated: list[int] = []  # every token streamed to the client so far
        self.num_cached = 0
        self.first_token_at = 0.0
        self.done = False
        # NOTE: each attempt has its own id on the workers: a late abort of a failed attempt (Ray delivers an
        # async actor's calls in no fixed order) can never hit the attempt that replaced it.
        # NOTE: ... and a client reusing a request id for two requests at once never mixes them up on a worker
        self.attempt_id = self._new_attempt_id()
        self.touched: set[tuple[str, str]] = set()  # (worker, attempt id) pairs to abort if the run fails

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        try:
            res = await self.prefill_with_failover() if self.prefill_worker is not None else None
            if res is not None:
                yield first_chunk(self, res)
                if self.done:  # NOTE: nothing was handed off: the decode stream waiting for the KV is let go
                    return
            opened, self.handoff = self.handoff, None
            # NOTE: aclosing: a run closed at its yield closes the attempt now (the worker's inflight count)
            async with contextlib.aclosing(self.decode_with_failover(opened)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if self.handing_off is not None:
                self.handing_off.cancel()
            if self.handoff is not None:
                self._drop(self.handoff)
            if not self.done:  # the client went away or every worker failed: free the request's blocks everywhere
                for name, attempt_id in self.touched:
                    self.pools[name].actor.abort.remote(attempt_id)

    # ---- 1. prefill ------------------------------------------------------------------------------------------
    async def prefill_with_failover(self) -> PrefillResult | None:
        """The first token; None when no prefill worker could serve and the decode worker will run it whole."""
        tried: set[str] = set()
        for attempt in range(MAX_FAILOVERS + 1):
            worker = self.prefill_worker
            assert worker is not None
            try:
                return await self._prefill(worker)
            except Exception as e:  # noqa: BLE001 - classified below
                if not can_fail_over(e) or attempt == MAX_FAILOVERS:
                    raise
                log.warning("prefill on %s failed (%s); trying elsewhere", worker.name, unwrap(e))
                self.metrics.retry("prefill")
                tried.add(worker.name)
                self._report_prefill_failure(worker, unwrap(e))
                worker.actor.abort.remote(self.attempt_id)
                if self.handoff is not None:  # NOTE: frees a reservation left behind, ends the waiting stream
                    self._drop(self.handoff)
                    self.handoff = None
                self.attempt_id = self._new_attempt_id()
                if isinstance(unwrap(e), TransferError):  # the decode side may be what failed: pick another too
                    self._move_decode(exclude={self.decode_worker.name})
                self.prefill_worker = self.pools.pick_prefill(self.prompt_len, tried, self.request.params.lora)
                if self.prefill_worker is None:
                    self.timeline.prefill_skipped, self.timeline.prefill_worker = True, ""
                    return None
        return None

    def _report_prefill_failure(self, worker: WorkerHandle, error: BaseException) -> None:
        """Tell the pools which worker failed: the decode side when the KV could not be handed over there (dead,
        or full: either way the next request is better placed elsewhere for a while), else the prefill worker."""
        self.pools.mark_failed(self.decode_worker.name if isinstance(error, TransferError) else worker.name)

    async def _prefill(self, worker: WorkerHandle) -> PrefillResult:
        self.timeline.prefill_worker = worker.name
        self.touched.update(((worker.name, self.attempt_id), (self.decode_worker.name, self.attempt_id)))
        worker.view.inflight += 1
        worker.view.pending_tokens += self.prompt_len
        span = tracing.start("prefill", self.traceparent, **{"pdcluster.worker": worker.name,
                                                              "pdcluster.decode_worker": self.decode_worker.name})
        self.handoff = self._open_handoff()
        try:
            request = PrefillRequest(self.attempt_id, self.request.token_ids, self.request.params,
                                     self.decode_worker.info.kv_address, tracing.traceparent_of(span))
            call = PrefillCall(worker, request)
            try:
                res = await call.first(self.prefill_timeout_s)
            except BaseException:
                call.close()
                raise
        finally:
            tracing.end(span)
            worker.view.inflight -= 1
            worker.view.pending_tokens -= self.prompt_len
        worker.view.observe_prefill(self.prompt_len - res.num_cached_tokens, res.prefill_ms)
        if res.finish_reason == "abort":
            call.close()
            raise WorkerFailed(f"prefill worker {worker.name} aborted the request", self.request_id)
        if res.handed_off:
            call.close()
        else:  # NOTE: the first token came before the KV landed: the rest of the call runs beside the decode stream
            assert self.handoff is not None
            self.handing_off = HandOff(call, self.handoff, self.timeline, self.prefill_timeout_s, self.request_id)
        return res

    # ---- 2. decode -------------------------------------------------------------------------------------------
    def _open_handoff(self) -> OpenStream:
        """The decode worker's stream for the KV this prefill attempt sends: it decodes as soon as the KV lands."""
        # NOTE: the stream waits for the KV at most as long as the router waits for the prefill, plus a margin
        request = DecodeRequest(self.attempt_id, self.request.params, sent_chars=None,
                                kv_wait_s=self.prefill_timeout_s + 30.0)
        return self._open(self.decode_worker, request, handoff=True)

    def _open(self, worker: WorkerHandle, request: DecodeRequest, *, handoff: bool = False) -> OpenStream:
        span = tracing.start("decode", self.traceparent, **{"pdcluster.worker": worker.name})
        if span is not None:
            request = dataclasses.replace(request, traceparent=tracing.traceparent_of(span))
        self.touched.add((worker.name, request.request_id))
        # NOTE: without a window the worker sends every delta as it is made, whether the router reads or not: a
        # client that stops reading would pile the whole generation up in the router's memory
        request = dataclasses.replace(request, window=self.stream_window, stream_interval=self.stream_interval)
        return OpenStream(worker, request.request_id, open_stream(worker, request, self.stream_window), span, handoff)

    def _drop(self, opened: OpenStream) -> None:
        """Let a stream go unread: its worker is told to abort the attempt (freeing its KV or reservation)."""
        tracing.end(opened.span)
        opened.stream.close()
        opened.worker.actor.abort.remote(opened.attempt_id)

    async def decode_with_failover(self, opened: OpenStream | None) -> AsyncGenerator[Chunk, None]:
        """The decode worker's chunks (`opened`: the handoff's stream); on a failure, the rest from another worker."""
        if opened is None:  # NOTE: no prefill: the decode worker runs the whole request
            opened = self._open(self.decode_worker, DecodeRequest(self.attempt_id, self.request.params,
                                                                  self.request.token_ids))
        for attempt in range(MAX_FAILOVERS + 1):
            worker = opened.worker
            worker.view.inflight += 1
            try:
                async with contextlib.aclosing(self._decode(opened)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except Exception as e:  # noqa: BLE001 - classified below
                if not can_fail_over(e) or attempt == MAX_FAILOVERS:
                    raise
                log.warning("decode on %s failed after %d tokens (%s); continuing elsewhere", worker.name,
                            len(self.generated), unwrap(e) if not isinstance(e, Stalled) else e)
                self.metrics.failover("decode")
                self.pools.mark_failed(worker.name)
                worker.actor.abort.remote(opened.attempt_id)
                self.attempt_id = self._new_attempt_id()
                self._move_decode(exclude={worker.name})
                if not await wait_alive(self.decode_worker.actor, self.decode_worker.name, self.deadline):
                    raise WorkerFailed(f"no decode worker to continue on ({self.decode_worker.name} is down)",
                                       self.request_id) from e
                opened = self._open(self.decode_worker, self.continuation())
            finally:
                worker.view.inflight -= 1  # NOTE: this attempt's worker, not the one the run moved on to

    def continuation(self) -> DecodeRequest:
        """The rest of the request: the prompt, every token streamed so far as output, and the text sent of them."""
        return DecodeRequest(self.attempt_id, self.request.params, self.request.token_ids,
                             output_token_ids=list(self.generated), sent_chars=self.text.sent_chars)

    async def _decode(self, opened: OpenStream) -> AsyncGenerator[Chunk, None]:
        worker, stream = opened.worker, opened.stream
        # NOTE: the first delta of a stream that computes the prompt first may take a prefill's time
        wait_s = self.prefill_timeout_s if not opened.handoff else self.stall.timeout(worker.name, self.stream_interval)
        made_at = 0.0  # the previous delta's stamp (the worker's clock)
        try:
            while True:
                # NOTE: the stall timeout runs from when the router asks for the next delta: time spent waiting on
                # the client (a slow reader blocks the yield below) is not the worker's
                try:
                    delta = await stream.next(min(wait_s, max(0.0, self.deadline - time.monotonic())))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise Stalled(f"decode worker {worker.name} sent no token for {wait_s:.1f} s") from None
                now = time.monotonic()
                if made_at and delta.made_at and delta.token_ids:
                    # NOTE: the worker's time per token, by its own clock: a delta that waited for a slow client
                    # carries every step made meanwhile, and a stream read late measures nothing of the client
                    self.stall.observe(worker.name, (delta.made_at - made_at) / len(delta.token_ids))
                made_at, wait_s = delta.made_at, self.stall.timeout(worker.name, self.stream_interval)
                if not self.first_token_at:
                    self.first_token_at = now
                    self.timeline.first_token_ms = (self.first_token_at - self.arrived) * 1e3
                    self.timeline.queue_ms, self.timeline.prefill_ms = delta.queue_ms, delta.prefill_ms
                    self.num_cached = delta.num_cached_tokens
                if opened.handoff and delta.resumed_chars != self.text.sent_chars and delta.finish_reason != "abort":
                    # NOTE: the worker's count of the first token's streamed characters differs from the prefill
                    # worker's own: its text would not continue the client's exactly; the continuation will
                    raise WorkerFailed(f"decode worker {worker.name} resumed the text at character "
                                       f"{delta.resumed_chars}, the client has {self.text.sent_chars}",
                                       self.request_id)
                opened.handoff = False
                self.generated += delta.token_ids
                if delta.finished and self.handing_off is not None:
                    await self.handing_off.settled()
                yield chunk_of(self, delta)
                if delta.finished:
                    return
            raise WorkerFailed(f"decode worker {worker.name} ended the stream without finishing", self.request_id)
        finally:
            stream.close()
            tracing.end(opened.span)

    def _move_decode(self, exclude: set[str]) -> None:
        """Another decode worker for the run (the same one when there is no other)."""
        params = self.request.params
        self.decode_worker = (self.pools.pick_decode(self.prompt_len, params.max_tokens, exclude, params.lora)
                              or self.decode_worker)
        self.timeline.decode_worker = self.decode_worker.name

    def _new_attempt_id(self) -> str:
        return f"{self.request_id}~{uuid.uuid4().hex[:8]}"
