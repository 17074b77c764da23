"""DecodeWorker: takes a request's transferred KV into its continuous batch and streams the tokens back.

Life of a request on a decode worker:
1. the router opens the request's stream (`generate(DecodeRequest)`, sampling params included) together with its
   prefill: the stream waits (`decode_workers/handoff.py`) while the KV arrives through this worker's KV endpoint
   (`ReceiverEndpoint`): blocks are reserved at the handshake, written as layers arrive, DONE at commit;
2. the moment the prefill worker commits, the transfer joins the running batch and decoding starts; no call from
   the router is awaited in between. With `token_ids` set the whole request runs here instead (the colocated
   mode, a prompt this worker already caches almost entirely, or a failover's continuation);
3. each step's new tokens are merged into `Delta`s (cluster/request_stream.py, the one streaming loop of every
   worker) and yielded to the router until the request finishes. The
   router opens the stream with a window (Ray's `_generator_backpressure_num_objects`): while that many deltas
   are unread (its client reads slowly) the yield waits, and the next delta carries every step made meanwhile; with
   as many steps undelivered the sequence pauses in the engine (its blocks kept, `cluster/backlog.py`) and resumes
   when the router reads again; a client that stops reading for good is cut off by the router, whose abort frees
   the blocks;
4. a caller that goes away (the generator is closed or cancelled) or an abort ends the request: its blocks (or the
   reservation it waited on) are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from cluster import tracing
from cluster.messages import DecodeRequest, Delta
from cluster.request_stream import RequestStream
from cluster.worker import RequestAborted, Worker, WorkerSpec, node_address
from decode_workers.handoff import KVWaiters, first_token_chars
from engine.loader import LoadedModel
from kv_transfer.endpoint import ReceiverEndpoint
from kv_transfer.receiver import KVReceiver
from kv_transfer.state import TransferError, TransferState

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    """A decode-pool (or colocated) worker (plain class; `decode_workers.actor.DecodeActor` wraps it for Ray)."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        self.kv_endpoint: ReceiverEndpoint | None = None  # NOTE: set first: the heartbeat thread may ask for kv_address
        super().__init__(spec, loaded)
        self.kv_endpoint = ReceiverEndpoint(self.engine, self.spec.transfer, engine_lock=self.loop.between_steps,
                                   host=node_address(self.spec.kv_host))
        self.kv_waiters = KVWaiters()
        self.receiver.on_settled = self.kv_waiters.settled

    @property
    def kv_address(self) -> str:
        return self.kv_endpoint.address if self.kv_endpoint is not None else ""

    async def generate(self, req: DecodeRequest) -> AsyncGenerator[Delta, None]:
        """Stream the request's new tokens; the last Delta has `finished` set and the totals."""
        stream = RequestStream(self, req)
        rid = req.request_id
        receiver = self.receiver

        def join_kv(engine: object) -> None:  # the transfer is DONE: decoding starts now
            self._check_not_aborted(rid)
            if req.sent_chars is None:
                stream.resumed_chars = first_token_chars(self.engine.tokenizer, receiver.next_token_ids(rid),
                                                         req.params)
            receiver.take(rid, req.params, sent_chars=stream.resumed_chars)
            self.loop.attach(rid, stream.on_output)

        if not stream.whole and not await self._kv_landed(rid, req.kv_wait_s):
            yield Delta([], "", finished=True, finish_reason="abort")  # NOTE: the router fails it over
            return
        span = tracing.start("decode.worker", req.traceparent, **{"pdcluster.worker": self.name})
        # NOTE: the KV came over the transfer: its take is a span
        kv = span is not None and not stream.whole
        take = tracing.start("kv_take", tracing.traceparent_of(span)) if kv else None
        try:
            await stream.start(stream.join_whole if stream.whole else join_kv)
        except BaseException as e:
            tracing.end(span)
            if not stream.whole and isinstance(e, (RequestAborted, TransferError)):
                # NOTE: aborted, or the transfer expired, between DONE and the take: nothing joined the batch
                yield Delta([], "", finished=True, finish_reason="abort")
                return
            raise
        finally:
            tracing.end(take)
        try:
            # NOTE: aclosing: a caller gone closes the deltas at once (their abort frees the blocks), not at collection
            async with contextlib.aclosing(stream.deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            tracing.end(span)

    async def _kv_landed(self, rid: str, wait_s: float) -> bool:
        """Wait for the request's KV: True once DONE; False if it failed, was aborted or did not come in `wait_s`."""
        landed = self.kv_waiters.register(rid)
        try:
            if rid in self._aborted:  # NOTE: the router's abort may overtake this call (Ray orders neither)
                return False
            if self.receiver.poll(rid) is TransferState.DONE:  # NOTE: committed before this call came
                return True
            return await asyncio.wait_for(landed, wait_s)
        except TimeoutError:
            log.warning("no KV came within %.0f s; giving the request up", wait_s)
            await asyncio.to_thread(self.abort, rid, "no KV came in time")
            return False
        except asyncio.CancelledError:
            await asyncio.to_thread(self.abort, rid, "the router went away")
            raise
        finally:
            self.kv_waiters.forget(rid)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request here: running, still arriving as KV (its reservation is freed), or waiting for it."""
        def stop(engine: object) -> None:
            self._remember_abort(request_id)
            self.kv_waiters.wake(request_id, False)
            self.loop.abort(request_id)
            self.receiver.abort_request(request_id, reason)
        self.loop.call(stop)  # NOTE: blocks until the current step ends: call it off the event loop

    @property
    def receiver(self) -> KVReceiver:
        assert self.kv_endpoint is not None
        return self.kv_endpoint.receiver

    def close(self) -> None:
        if self.kv_endpoint is not None:
            self.kv_endpoint.close()
        super().close()

