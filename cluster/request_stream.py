"""RequestStream: one request's outputs on a worker's engine, streamed as `Delta`s (the one streaming loop).

Every worker that streams a request's tokens does it here: a decode worker for a request whose KV it took, or one it
runs whole (`token_ids` set: colocated, prefix rule, SLO rule, a failover's continuation), and a prefill worker for
a request that stays where it is prefilled (router/policy.py, "stay"). Life of a stream:
1. `start(fn)`: `fn` runs in the engine loop between two steps and puts the request in the batch with `on_output`
   attached (`join_whole` for a whole request: the prompt, with any tokens a failed worker streamed before,
   `output_token_ids`, recomputed; the engine cuts it into chunks under its ITL budget while it decodes for others);
   a caller cancelled meanwhile still lets `fn` finish, then aborts the request, so nothing joins after its abort;
2. on the delta channel (a `Relay` taken from cluster/delta_server.py) each output leaves from the engine thread as
   its own Delta (most as a tuple), in the step's frame, or with `stream_interval` N > 1 (the router's) the outputs
   of N tokens as one Delta (the first output and the last at once); through Ray, `deltas()` yields each batch of
   outputs made since its last yield merged into one Delta. Either way a delta is stamped with the time the engine
   made its last token (`made_at`, on the backlog's busy clock); the first carries how many characters the client
   had (`resumed_chars`) and, for a whole request, the queue and prefill time on this worker; with `req.window`
   outputs (on the delta channel: deltas) not yet taken (acknowledged by the router; its client reads slowly or not
   at all) the sequence pauses in the engine (blocks kept, cluster/backlog.py) and resumes when the consumer takes a
   delta again;
3. a caller that goes away before the last Delta (the generator closed or cancelled) aborts the request: the
   worker's `abort` frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from cluster.backlog import Backlog
from cluster.delta_server import take_relay
from cluster.delta_wire import PlainDelta, plain
from cluster.logs import REQUEST_ID
from cluster.messages import DecodeRequest, Delta
from engine.errors import InvalidRequestError
from engine.output import RequestOutput

if TYPE_CHECKING:
    from cluster.worker import Worker


class RequestStream:
    """The outputs of one request on `worker`'s engine, from the start call to its last Delta."""

    def __init__(self, worker: Worker, req: DecodeRequest) -> None:
        self.worker, self.req = worker, req
        self.request_id = req.request_id
        self.arrived = time.monotonic()
        REQUEST_ID.set(req.request_id)
        self.whole = bool(req.token_ids)  # the prompt is computed here (no KV came for it)
        self.resumed_chars = req.sent_chars or 0  # characters of the output text the client has at the start
        self._aio = asyncio.get_running_loop()
        self._outlet = worker.outlet(self._aio)
        # NOTE: a stream of the delta channel sends each output from the engine thread (cluster/delta_server.py
        # `Relay`); otherwise (Ray's generator) outputs reach `deltas()` through the event loop
        self._relay = take_relay()
        self._ended: asyncio.Future[None] = self._aio.create_future()
        self._resuming: set[asyncio.Future[object]] = set()
        if self._relay is not None:
            self._relay.on_ack = self._acked
        self._first = True
        # NOTE: each output with when the engine made it: a stream paused by backpressure (its client reads slowly)
        # merges what came meanwhile, stamped with the engine's time, not the time it was sent (router/stall.py)
        self._outputs: asyncio.Queue[tuple[float, RequestOutput]] = asyncio.Queue()
        self._backlog = Backlog(req.window)
        self._held: list[RequestOutput] = []  # (the delta channel) outputs not sent: under stream_interval tokens
        self._timing: list[tuple[float, float]] = []  # a whole request: its queue and prefill time here (ms)
        # NOTE: records under the worker's own module (decode_workers.worker, prefill_workers.worker), as before
        self._log = logging.getLogger(type(worker).__module__)

    def on_output(self, out: RequestOutput) -> None:
        """The engine loop's hook (its thread, under the lock): queue the step's output for `deltas`, or (the delta
        channel) send it, once `stream_interval` tokens are held (the first output and the last at once)."""
        if self.whole and not self._timing:
            self._timing.append(self.worker._first_token(self.request_id, time.monotonic()))
        if self._relay is not None:
            self._held.append(out)
            interval = self.req.stream_interval
            if not (interval <= 1 or self._first or out.finished
                    or sum(len(o.new_token_ids) for o in self._held) >= interval):
                return  # NOTE: not counted undelivered: the window counts deltas (the router acknowledges deltas)
        made_at, pause = self._backlog.made()
        if pause and not out.finished:  # NOTE: between two steps: the next one already leaves it out
            self.worker.engine.pause_request(self.request_id)
        if self._relay is None:
            self._outlet.put(self._outputs.put_nowait, (made_at, out))
            return
        held, self._held = self._held, []
        item: Delta | PlainDelta
        if len(held) > 1 or self._first or out.finished or out.new_logprobs or out.prompt_logprobs is not None:
            item = self._delta([(made_at, o) for o in held])
        else:  # NOTE: most outputs: the tuple `to_wire` makes of a plain Delta, without the Delta
            item = plain(out.new_token_ids, out.new_text, made_at, out.num_prompt_tokens, out.num_cached_tokens)
            self.worker.metrics.generation.inc(len(out.new_token_ids))
        self._relay.send_at_step_end(item, self._outlet)
        if out.finished:
            self._outlet.put(self._end, None)

    def _end(self, _: object) -> None:  # the event loop: the last delta is on its way
        if not self._ended.done():
            self._ended.set_result(None)

    def _acked(self, n: int) -> None:
        """(the event loop) the router took `n` of the relayed deltas: a paused sequence may resume."""
        if self._backlog.delivered(n):
            resume = self.worker.loop.run_between_steps(self._resume)
            if not resume.done():  # NOTE: it went to a thread (the engine was stepping): kept until it ends
                self._resuming.add(resume)
                resume.add_done_callback(self._resuming.discard)

    def join_whole(self, engine: object) -> None:
        """A `start` function: the whole request (its prompt) joins the engine's batch."""
        w, req = self.worker, self.req
        if not req.token_ids:
            raise InvalidRequestError("token_ids", "a whole request on this worker needs its prompt", self.request_id)
        w._check_not_aborted(self.request_id)
        seq = w.engine.add_request(self.request_id, req.token_ids, req.params, output_token_ids=req.output_token_ids,
                                   sent_chars=self.resumed_chars)
        w._track(seq, self.arrived)
        w.loop.attach(self.request_id, self.on_output)

    def _resume(self, engine: object) -> None:
        """A loop call: the paused sequence is stepped again (its consumer took a delta)."""
        self.worker.engine.resume_request(self.request_id)

    async def start(self, fn: Callable[[object], None]) -> None:
        """Run `fn` in the engine loop between two steps; a cancelled caller aborts the request after it."""
        # NOTE: off the event loop (the engine lock is held for a whole step, other streams must not wait), and
        # shielded: if this call is cancelled meanwhile, the start still completes before the abort below runs,
        # so a request can never join the batch after its abort
        starting = self.worker.loop.run_between_steps(fn)  # NOTE: done at once if the engine was between steps
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await starting
            await asyncio.to_thread(self.worker.abort, self.request_id)
            raise

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The request's Deltas until the one with `finished` set (none when they go by the relay: this returns
        after the last one is sent); a caller gone before it aborts the request."""
        finished = False
        try:
            if self._relay is not None:
                await self._ended
                finished = True
            while not finished:
                batch = [await self._outputs.get()]
                while not self._outputs.empty():
                    batch.append(self._outputs.get_nowait())
                delta = self._delta(batch)
                finished = delta.finished
                yield delta
                if self._backlog.delivered(len(batch)):
                    await asyncio.to_thread(self.worker.loop.call, self._resume)
        finally:
            if not finished:
                await asyncio.to_thread(self.worker.abort, self.request_id)

    def _delta(self, batch: list[tuple[float, RequestOutput]]) -> Delta:
        """The outputs of `batch` as one Delta; the stream's first carries where the client's text resumes and, for a
        whole request, its queue and prefill time here."""
        delta = merge([out for _, out in batch])
        delta.made_at = batch[-1][0]
        if self._first:
            self._first = False
            delta.resumed_chars = self.resumed_chars
            if self._timing:
                delta.queue_ms, delta.prefill_ms = self._timing[0]
        self.worker.metrics.generation.inc(len(delta.token_ids))
        if delta.finished:
            self._log.debug("finished (%s): %d tokens", delta.finish_reason, len(delta.all_token_ids))
        return delta


def merge(outs: list[RequestOutput]) -> Delta:
    """Several steps' outputs of one request as one Delta (the router gets fewer, larger messages)."""
    last = outs[-1]
    d = Delta([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), last.finished,
              last.finish_reason)
    if last.finished:
        d.final_text, d.all_token_ids = last.text, list(last.token_ids)
    d.num_prompt_tokens, d.num_cached_tokens = last.num_prompt_tokens, last.num_cached_tokens
    d.logprobs = [lp for o in outs for lp in o.new_logprobs]
    d.prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return d
