"""DecodeWorker: takes a request's transferred KV into its continuous batch and streams the tokens back.

Life of a request on a decode worker:
1. the KV arrives through this worker's KV endpoint (`ReceiverEndpoint`) while the prefill worker computes it:
   blocks are reserved at the handshake, written as layers arrive, and the transfer is DONE at commit;
2. `generate(DecodeRequest)` takes the finished transfer into the running batch with the request's sampling
   params (or, with `token_ids` set, runs the whole request here: the colocated mode, or a prompt this worker
   already caches almost entirely);
3. each step's new tokens are merged into `Delta`s and yielded to the router until the request finishes;
4. a caller that goes away (the generator is closed or cancelled) aborts the request: its blocks are freed.
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
from cluster.worker import Worker, WorkerSpec, node_address
from engine.loader import LoadedModel
from engine.output import RequestOutput
from kv_transfer.endpoint import ReceiverEndpoint
from kv_transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    """A decode-pool (or colocated) worker (plain class; `decode_workers.actor.DecodeActor` wraps it for Ray)."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        self.kv_endpoint: ReceiverEndpoint | None = None  # NOTE: set first: the heartbeat thread may ask for kv_address
        super().__init__(spec, loaded)
        self.kv_endpoint = ReceiverEndpoint(self.engine, self.spec.transfer, engine_lock=self.loop.between_steps,
                                   host=node_address(self.spec.kv_host))

    @property
    def kv_address(self) -> str:
        return self.kv_endpoint.address if self.kv_endpoint is not None else ""

    async def generate(self, req: DecodeRequest) -> AsyncIterator[Delta]:
        """Stream the request's new tokens; the last Delta has `finished` set and the totals."""
        arrived, rid = time.monotonic(), req.request_id
        REQUEST_ID.set(rid)
        aio = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        timing: list[tuple[float, float]] = []  # a request run whole here: its queue and prefill time (ms)

        def on_output(out: RequestOutput) -> None:  # the loop thread, under the lock
            if req.token_ids and not timing:
                timing.append(self._first_token(rid, time.monotonic()))
            aio.call_soon_threadsafe(outputs.put_nowait, out)

        if req.token_ids:
            def start(engine: object) -> None:
                self._check_not_aborted(rid)
                seq = self.engine.add_request(rid, req.token_ids, req.params, output_token_ids=req.output_token_ids,
                                              sent_chars=req.sent_chars)
                self._track(seq, arrived)
                self.loop.attach(rid, on_output)
        else:
            receiver = self.receiver

            def start(engine: object) -> None:  # NOTE: the router calls only once the transfer is DONE
                self._check_not_aborted(rid)
                receiver.take(rid, req.params, sent_chars=req.sent_chars)
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
            raise
        finally:
            tracing.end(take)
        try:
            first = True
            while not finished:
                batch = [await outputs.get()]
                while not outputs.empty():
                    batch.append(outputs.get_nowait())
                delta = _merge(batch)
                if first and timing:
                    delta.queue_ms, delta.prefill_ms = timing[0]
                first = False
                finished = delta.finished
                self.metrics.generation.inc(len(delta.token_ids))
                if finished:
                    log.debug("finished (%s): %d tokens", delta.finish_reason, len(delta.all_token_ids))
                yield delta
        finally:
            tracing.end(span)
            if not finished:
                await asyncio.to_thread(self.abort, rid)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request here: running, or still arriving as KV (its reservation is freed)."""
        def stop(engine: object) -> None:
            self._remember_abort(request_id)
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
    return d
