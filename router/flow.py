"""One request's way through the pools, with failover: the part of the router that talks to the workers.

Life of a request run:
1. prefill: the chosen prefill worker computes the prompt and ships the KV to the chosen decode worker; the first
   token is streamed at once. If the prefill worker dies, times out or the transfer fails, the run tries another
   prefill worker (and, if the transfer failed, another decode worker); with none left, a decode worker runs the
   whole request itself;
2. decode: the decode worker streams the rest. If it dies mid-stream, the run continues on another decode worker
   (or the same one once Ray restarted it) with the prompt plus every token already streamed: the client sees no
   token lost or repeated, and a greedy request ends with the same text as an undisturbed run;
3. the last chunk carries the finish reason, usage and timeline; a run that does not finish aborts the request on
   every worker it touched, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult
from engine.errors import InvalidRequestError
from kv_transfer.state import TransferError
from router.errors import WorkerFailed, unwrap
from router.policy import Route
from router.v1 import inference_pb2 as pb
from router.validate import Checked

if TYPE_CHECKING:
    from router.core import Router, WorkerHandle

log = logging.getLogger(__name__)
MAX_FAILOVERS = 3  # per phase


def can_fail_over(exc: BaseException) -> bool:
    """Whether another worker may succeed where this one failed (not for bad input or a cancelled client)."""
    return not isinstance(unwrap(exc), InvalidRequestError)


class RequestRun:
    """The state of one request across workers: what was streamed, where, and when."""

    def __init__(self, router: Router, req: Checked, route: Route, arrived: float) -> None:
        self.router, self.req, self.arrived = router, req, arrived
        self.rid, self.n = req.request_id, len(req.token_ids)
        self.d = router.workers[route.decode]
        self.p = router.workers[route.prefill] if route.prefill else None
        self.tl = pb.Timeline(decode_worker=self.d.name, prefill_skipped=self.p is None)
        self.generated: list[int] = []  # every token streamed to the client so far
        self.sent_text = ""
        self.text_base = ""  # text of the tokens generated before the current decode worker took over
        self.n_cached = 0
        self.t_first = 0.0
        self.done = False
        # NOTE: each attempt has its own id on the workers: a late abort of a failed attempt (Ray delivers an
        # async actor's calls in no fixed order) can never hit the attempt that replaced it.
        # NOTE: ... and a client reusing a request id for two requests at once never mixes them up on a worker
        self.wid = f"{self.rid}~{uuid.uuid4().hex[:8]}"
        self.touched: set[tuple[str, str]] = set()  # (worker, attempt id) pairs to abort if the run fails

    async def chunks(self) -> AsyncGenerator[pb.GenerateChunk, None]:
        try:
            res = await self._prefill_with_failover() if self.p is not None else None
            dreq = DecodeRequest(self.wid, self.req.params, self.req.token_ids)
            if res is not None:
                yield self._first_token(res)
                if self.done:
                    return
                dreq = DecodeRequest(self.wid, self.req.params)
            async for chunk in self._decode_with_failover(dreq):
                yield chunk
        finally:
            if not self.done:  # the client went away or every worker failed: free the request's blocks everywhere
                for name, wid in self.touched:
                    self.router.workers[name].actor.abort.remote(wid)

    # ---- prefill ---------------------------------------------------------------------------------------------
    async def _prefill_with_failover(self) -> PrefillResult | None:
        """The first token; None when no prefill worker could serve and the decode worker will run it whole."""
        tried: set[str] = set()
        for attempt in range(MAX_FAILOVERS + 1):
            assert self.p is not None
            try:
                return await self._prefill(self.p)
            except Exception as e:  # noqa: BLE001 - classified below
                if not can_fail_over(e) or attempt == MAX_FAILOVERS:
                    raise
                log.warning("prefill on %s failed (%s); trying elsewhere", self.p.name, unwrap(e))
                self.router.metrics.retry("prefill")
                tried.add(self.p.name)
                self.p.actor.abort.remote(self.wid)
                self.d.actor.abort.remote(self.wid)  # NOTE: frees a reservation the transfer left behind
                self._next_attempt()
                if isinstance(unwrap(e), TransferError):  # the decode side may be what failed: pick another too
                    self.d = self.router.pick_decode(self.req, exclude={self.d.name}) or self.d
                    self.tl.decode_worker = self.d.name
                self.p = self.router.pick_prefill(self.req, exclude=tried)
                if self.p is None:
                    self.tl.prefill_skipped, self.tl.prefill_worker = True, ""
                    return None
        return None

    async def _prefill(self, p: WorkerHandle) -> PrefillResult:
        self.tl.prefill_worker = p.name
        self.touched.update(((p.name, self.wid), (self.d.name, self.wid)))
        p.view.inflight += 1
        p.view.pending_tokens += self.n
        try:
            res: PrefillResult = await asyncio.wait_for(p.actor.prefill.remote(
                PrefillRequest(self.wid, self.req.token_ids, self.req.params, self.d.info.kv_address)),
                self.router.prefill_timeout_s)
        finally:
            p.view.inflight -= 1
            p.view.pending_tokens -= self.n
        p.view.observe_prefill(self.n - res.num_cached_tokens, res.prefill_ms)
        if res.finish_reason == "abort":
            raise WorkerFailed(f"prefill worker {p.name} aborted the request", self.rid)
        return res

    def _first_token(self, res: PrefillResult) -> pb.GenerateChunk:
        self.t_first = time.monotonic()
        tl = self.tl
        tl.prefill_ms, tl.transfer_ms = res.prefill_ms, res.transfer_ms
        tl.queue_ms = max(0.0, (self.t_first - self.arrived) * 1e3 - res.prefill_ms - res.transfer_ms)
        tl.kv_blocks_sent, tl.kv_bytes_sent = res.kv_blocks_sent, res.kv_bytes_sent
        tl.first_token_ms = (self.t_first - self.arrived) * 1e3
        self.n_cached = res.num_cached_tokens
        self.generated += res.token_ids
        if res.finished:
            self.done = True
            return self._last(res.token_ids, res.text, res.finish_reason, res.final_text)
        self.sent_text = res.text
        return pb.GenerateChunk(request_id=self.rid, token_ids=res.token_ids, text=res.text)

    # ---- decode ----------------------------------------------------------------------------------------------
    async def _decode_with_failover(self, dreq: DecodeRequest) -> AsyncGenerator[pb.GenerateChunk, None]:
        for attempt in range(MAX_FAILOVERS + 1):
            self.touched.add((self.d.name, self.wid))
            self.d.view.inflight += 1
            try:
                async for chunk in self._decode(self.d, dreq):
                    yield chunk
                return
            except Exception as e:  # noqa: BLE001 - classified below
                if not can_fail_over(e) or attempt == MAX_FAILOVERS:
                    raise
                log.warning("decode on %s failed after %d tokens (%s); continuing elsewhere", self.d.name,
                            len(self.generated), unwrap(e))
                self.router.metrics.failover("decode")
                self.d.actor.abort.remote(self.wid)
                self._next_attempt()
                self.d = self.router.pick_decode(self.req, exclude={self.d.name}) or self.d
                self.tl.decode_worker = self.d.name
                dreq = self._continuation()
            finally:
                self.d.view.inflight -= 1

    def _next_attempt(self) -> None:
        self.wid = f"{self.rid}~{uuid.uuid4().hex[:8]}"

    def _continuation(self) -> DecodeRequest:
        """The rest of the request as a new one: the prompt plus every token streamed so far."""
        params, n_out = self.req.params, len(self.generated)
        self.text_base = self.router.tokenizer.decode(self.generated,
                                                                skip_special_tokens=params.skip_special_tokens)
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - n_out,
                                   output_offset=params.output_offset + n_out)
        return DecodeRequest(self.wid, rest, self.req.token_ids + self.generated)

    async def _decode(self, d: WorkerHandle, dreq: DecodeRequest) -> AsyncGenerator[pb.GenerateChunk, None]:
        gen = d.actor.generate.options(num_returns="streaming").remote(dreq)
        async for ref in gen:
            delta: Delta = await ref
            if not self.t_first:
                self.t_first = time.monotonic()
                self.tl.first_token_ms = (self.t_first - self.arrived) * 1e3
                self.tl.queue_ms, self.tl.prefill_ms = delta.queue_ms, delta.prefill_ms
                self.n_cached = delta.num_cached_tokens
            self.generated += delta.token_ids
            if delta.finished:
                self.done = True
                yield self._last(delta.token_ids, delta.text, delta.finish_reason, self.text_base + delta.final_text)
                return
            self.sent_text += delta.text
            yield pb.GenerateChunk(request_id=self.rid, token_ids=delta.token_ids, text=delta.text)
        raise WorkerFailed(f"decode worker {d.name} ended the stream without finishing", self.rid)

    def _last(self, token_ids: list[int], text: str, reason: str | None, final_text: str) -> pb.GenerateChunk:
        """The final chunk: remaining text (a stop string's hold-back resolved), finish reason, usage, timeline."""
        if reason == "abort":
            self.done = False
            raise WorkerFailed("a worker aborted the request", self.rid)
        sent = self.sent_text + text
        if final_text.startswith(sent):
            text += final_text[len(sent):]
        now = time.monotonic()
        self.tl.decode_ms = (now - self.t_first) * 1e3 if self.t_first else 0.0
        self.tl.total_ms = (now - self.arrived) * 1e3
        usage = pb.Usage(prompt_tokens=self.n, completion_tokens=len(self.generated),
                         cached_prompt_tokens=self.n_cached)
        return pb.GenerateChunk(request_id=self.rid, token_ids=token_ids, text=text, finish_reason=reason or "",
                                usage=usage, timeline=self.tl)
