"""A whole request on one worker's engine, streamed as `Delta`s: the prompt and every token, no KV transfer.

The prefill pool serves requests this way when one stays where it is prefilled (router/policy.py, "stay": the decode
pool's steps are predicted slower), e.g. a prompt this prefill worker caches. Life of such a request:
1. `start`: the prompt (with any tokens a failed worker streamed before: `output_token_ids`, recomputed) joins the
   engine's batch; the engine cuts it into chunks under its ITL budget while it decodes for others;
2. each step's outputs are merged into one Delta (`merge`) and yielded; the first carries the queue and prefill time
   on this worker and how many characters the client had (`resumed_chars`);
3. a caller that goes away (the generator closed or cancelled) aborts the request: its blocks are freed.
NOTE: the decode pool's `DecodeWorker.generate` runs the same steps for its own whole requests, next to its KV path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from cluster.logs import REQUEST_ID
from cluster.messages import DecodeRequest, Delta
from engine.errors import InvalidRequestError
from engine.output import RequestOutput

if TYPE_CHECKING:
    from cluster.worker import Worker


async def run_whole(worker: Worker, req: DecodeRequest) -> AsyncIterator[Delta]:
    """Stream the request's tokens from `worker`'s engine; the last Delta has `finished` set and the totals."""
    if not req.token_ids:
        raise InvalidRequestError("token_ids", "a whole request on this worker needs its prompt", req.request_id)
    arrived, rid = time.monotonic(), req.request_id
    REQUEST_ID.set(rid)
    aio = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    timing: list[tuple[float, float]] = []  # its queue and prefill time here (ms)
    sent = req.sent_chars or 0

    def on_output(out: RequestOutput) -> None:  # the loop thread, under the lock
        if not timing:
            timing.append(worker._first_token(rid, time.monotonic()))
        aio.call_soon_threadsafe(outputs.put_nowait, out)

    def start(engine: object) -> None:
        worker._check_not_aborted(rid)
        seq = worker.engine.add_request(rid, req.token_ids, req.params, output_token_ids=req.output_token_ids,
                                        sent_chars=sent)
        worker._track(seq, arrived)
        worker.loop.attach(rid, on_output)

    # NOTE: off the event loop (the engine lock is held for a whole step), and shielded: if this call is cancelled
    # meanwhile, the start completes before the abort below runs, so the request never joins the batch after it
    starting = asyncio.ensure_future(asyncio.to_thread(worker.loop.call, start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(worker.abort, rid)
        raise
    finished = False
    try:
        first = True
        while not finished:
            batch = [await outputs.get()]
            while not outputs.empty():
                batch.append(outputs.get_nowait())
            delta = merge(batch)
            if first:
                delta.resumed_chars = sent
                if timing:
                    delta.queue_ms, delta.prefill_ms = timing[0]
            first = False
            finished = delta.finished
            worker.metrics.generation.inc(len(delta.token_ids))
            yield delta
    finally:
        if not finished:
            await asyncio.to_thread(worker.abort, rid)


def merge(outs: list[RequestOutput]) -> Delta:
    """Several steps' outputs of one request as one Delta (the router gets fewer, larger messages)."""
    last = outs[-1]
    d = Delta([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), last.finished,
              last.finish_reason)
    if last.finished:
        d.final_text, d.all_token_ids = last.text, list(last.token_ids)
    d.num_prompt_tokens, d.num_cached_tokens = last.num_prompt_tokens, last.num_cached_tokens
    return d
