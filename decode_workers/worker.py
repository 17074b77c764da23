"""DecodeWorker: takes a request's transferred KV into its continuous batch and streams the tokens back.

Life of a request on a decode worker:
1. the router opens the request's stream (`generate(DecodeRequest)`, sampling params included) together with its
   prefill: the stream waits (`decode_workers/handoff.py`) while the KV arrives through this worker's KV endpoint
   (`ReceiverEndpoint`): blocks are reserved at the handshake, written as layers arrive, DONE at commit;
2. the moment the prefill worker commits, the transfer joins the running batch and decoding starts; no call from
   the router is awaited in between. With `token_ids` set the whole request runs here instead (the colocated
   mode, a prompt this worker already caches almost entirely, or a failover's continuation);
3. each step's new tokens are merged into `Delta`s and yielded to the router until the request finishes. The
   router opens the stream with a window (Ray's `_generator_backpressure_num_objects`): while that many deltas
   are unread (its client reads slowly) the yield waits, and the next delta carries every step made meanwhile; with
   as many steps undelivered the sequence pauses in the engine (its blocks kept, `backlog.py`) and resumes when the
   router reads again; a client that stops reading for good is cut off by the router, whose abort frees the blocks;
4. a caller that goes away (the generator is closed or cancelled) or an abort ends the request: its blocks (or the
   reservation it waited on) are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from cluster import tracing
from cluster.logs import REQUEST_ID
from cluster.messages import DecodeRequest, Delta
from cluster.worker import RequestAborted, Worker, WorkerSpec, node_address
from decode_workers.backlog import Backlog
from decode_workers.handoff import KVWaiters, first_token_chars
from engine.loader import LoadedModel
from engine.output import RequestOutput
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

    async def generate(self, req: DecodeRequest) -> AsyncIterator[Delta]:
        """Stream the request's new tokens; the last Delta has `finished` set and the totals."""
        arrived, rid = time.monotonic(), req.request_id
        REQUEST_ID.set(rid)
        aio = asyncio.get_running_loop()
        # NOTE: each output with when the engine made it: a stream paused by backpressure (its client reads slowly)
        # merges what came meanwhile, stamped with the engine's time, not the time it was sent (router/stall.py)
        outputs: asyncio.Queue[tuple[float, RequestOutput]] = asyncio.Queue()

        timing: list[tuple[float, float]] = []  # a request run whole here: its queue and prefill time (ms)
        resumed = [req.sent_chars or 0]  # characters of the output text the client has when this stream starts
        backlog = Backlog(req.window)

        def on_output(out: RequestOutput) -> None:  # the loop thread, under the lock
            if req.token_ids and not timing:
                timing.append(self._first_token(rid, time.monotonic()))
            made_at, pause = backlog.made()
            if pause and not out.finished:  # NOTE: between two steps: the next one already leaves it out
                self.engine.pause_request(rid)
            aio.call_soon_threadsafe(outputs.put_nowait, (made_at, out))

        if req.token_ids:
            def start(engine: object) -> None:
                self._check_not_aborted(rid)
                seq = self.engine.add_request(rid, req.token_ids, req.params, output_token_ids=req.output_token_ids,
                                              sent_chars=resumed[0])
                self._track(seq, arrived)
                self.loop.attach(rid, on_output)
        else:
            receiver = self.receiver
            if not await self._kv_landed(rid, req.kv_wait_s):
                yield Delta([], "", finished=True, finish_reason="abort")  # NOTE: the router fails it over
                return

            def start(engine: object) -> None:  # the transfer is DONE: decoding starts now
                self._check_not_aborted(rid)
                if req.sent_chars is None:
                    resumed[0] = first_token_chars(self.engine.tokenizer, receiver.next_token_ids(rid), req.params)
                receiver.take(rid, req.params, sent_chars=resumed[0])
                self.loop.attach(rid, on_output)
        finished = False
        span = tracing.start("decode.worker", req.traceparent, **{"pdcluster.worker": self.name})
        if span is not None and not req.token_ids:  # NOTE: the KV came over the transfer: its take is a span
            take = tracing.start("kv_take", tracing.traceparent_of(span))
        else:
            take = None
        # NOTE: off the event loop (the engine lock is held for a whole step, other streams must not wait), and
        # shielded: if this call is cancelled meanwhile, the start still completes before the abort below runs,
        # so a request can never join the batch after its abort
        starting = asyncio.ensure_future(asyncio.to_thread(self.loop.call, start))
        try:
            await asyncio.shield(starting)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                with contextlib.suppress(Exception):
                    await starting
                await asyncio.to_thread(self.abort, rid)
            tracing.end(span)
            if not req.token_ids and isinstance(e, (RequestAborted, TransferError)):
                # NOTE: aborted, or the transfer expired, between DONE and the take: nothing joined the batch
                yield Delta([], "", finished=True, finish_reason="abort")
                return
            raise
        finally:
            tracing.end(take)
        try:
            first = True
            while not finished:
                batch = [await outputs.get()]
                while not outputs.empty():
                    batch.append(outputs.get_nowait())
                delta = _merge([out for _, out in batch])
                delta.made_at = batch[-1][0]
                if first:
                    delta.resumed_chars = resumed[0]
                    if timing:
                        delta.queue_ms, delta.prefill_ms = timing[0]
                first = False
                finished = delta.finished
                self.metrics.generation.inc(len(delta.token_ids))
                if finished:
                    log.debug("finished (%s): %d tokens", delta.finish_reason, len(delta.all_token_ids))
                yield delta
                if backlog.delivered(len(batch)):
                    await asyncio.to_thread(self.loop.call, lambda engine: engine.resume_request(rid))
        finally:
            tracing.end(span)
            if not finished:
                await asyncio.to_thread(self.abort, rid)

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


def _merge(outs: list[RequestOutput]) -> Delta:
    """Several steps' outputs of one request as one Delta (the router sends fewer, larger messages)."""
    last = outs[-1]
    d = Delta([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), last.finished,
              last.finish_reason)
    if last.finished:
        d.final_text, d.all_token_ids = last.text, list(last.token_ids)
    d.num_prompt_tokens, d.num_cached_tokens = last.num_prompt_tokens, last.num_cached_tokens
    d.logprobs = [lp for o in outs for lp in o.new_logprobs]
    d.prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return d
