"""PrefillWorker: runs prompts, samples the first token, ships the KV layer by layer to a decode worker.

Life of a request on a prefill worker:
1. handshake with the decode worker's KV endpoint (`prepare`): it reserves blocks and says how many leading
   blocks it already caches; only the rest will be sent;
2. the prompt joins this engine's batch (chunked prefill under the token budget, prefix cache hits skipped);
   during the step that completes it, each layer's KV is handed to the sender as soon as it is written, and
   moves while the next layers compute;
3. the first token is sampled: the sender commits it (the decode worker can take the request) and the request
   leaves this engine (its blocks stay in the prefix cache); a request that ends at its first token aborts the
   transfer instead;
4. the result (first token, timings, bytes sent) goes back once the decode worker confirmed the KV.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.logs import REQUEST_ID
from cluster.messages import PrefillRequest, PrefillResult
from cluster.worker import Worker, WorkerSpec
from engine.block_hash import hash_prompt_blocks
from engine.loader import LoadedModel
from engine.output import RequestOutput
from kv_transfer.endpoint import open_sender
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferError, TransferState

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    """A prefill-pool worker (plain class; `prefill_workers.actor.PrefillActor` wraps it for Ray)."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        super().__init__(spec, loaded)
        self._senders: dict[str, KVSender] = {}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill one prompt, ship its KV to `req.decode_address`; raises TransferError if the KV did not arrive."""
        arrived = time.monotonic()
        e, rid = self.engine, req.request_id
        REQUEST_ID.set(rid)
        tokens = e.tokenize(req.token_ids, rid)
        n = len(tokens)
        sender = open_sender(self.spec.transfer, req.decode_address, rid, e.kv_layout, tokens, n,
                             hash_prompt_blocks(tokens, e.config.block_size, e.scope), sender_id=self.name)
        self._senders[rid] = sender  # NOTE: before the handshake, so an abort during it reaches the sender
        aio = asyncio.get_running_loop()
        first: asyncio.Future[tuple[RequestOutput, float, float, float]] = aio.create_future()

        cached = 0

        def on_layer(layer: int) -> None:  # inside the forward pass: copy this layer's blocks out and hand them on
            sender.send_layer(layer, *e.read_kv_layer(rid, layer, cached, num_tokens=n))

        def on_output(out: RequestOutput) -> None:  # the loop thread, under the lock, before the next step
            # NOTE: nothing here may block (the engine waits): an abort of the transfer is a network call, so
            # it happens in the coroutine below; committing only queues the token for the sender's thread
            now = time.monotonic()
            queue_ms, prefill_ms = self._first_token(rid, now)
            if not out.finished:
                sender.commit(out.new_token_ids, out.num_cached_tokens)
                self.loop.release(rid)  # NOTE: decoding goes on elsewhere; the blocks stay in the prefix cache
            aio.call_soon_threadsafe(_set, first, (out, now, queue_ms, prefill_ms))

        def start(engine: object) -> None:
            self._check_not_aborted(rid)
            seq = e.add_request(rid, tokens, req.params)
            self._track(seq, arrived)
            e.watch_layers(rid, on_layer)
            self.loop.attach(rid, on_output)

        try:
            cached = await asyncio.to_thread(sender.prepare)
            try:
                await asyncio.to_thread(self.loop.call, start)
            except BaseException:
                await asyncio.to_thread(sender.abort, "the prefill worker rejected the request")
                raise
            out, t_first, queue_ms, prefill_ms = await first
            if out.finished:
                await asyncio.to_thread(sender.abort, "the request finished at its first token")
            else:
                state = await asyncio.to_thread(sender.wait, self.spec.transfer.deadline_s)
                if state is not TransferState.DONE:
                    raise sender.error or TransferError("KV transfer did not finish", rid, retryable=True)
        except asyncio.CancelledError:
            await asyncio.to_thread(self.abort, rid, "cancelled by the router")
            raise
        finally:
            self._senders.pop(rid, None)
        transfer_ms = (sender.finished_at - t_first) * 1e3 if not out.finished else 0.0
        log.debug("prefilled %d tokens (%d cached) in %.0f ms after %.0f ms queued; sent %d blocks (%d bytes) to %s, "
                  "%.1f ms after the first token", n, out.num_cached_tokens, prefill_ms, queue_ms, sender.num_blocks,
                  sender.bytes_sent, req.decode_address, transfer_ms)
        return PrefillResult(rid, out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.text, n,
                             out.num_cached_tokens, queue_ms, prefill_ms, max(0.0, transfer_ms),
                             sender.num_blocks if not out.finished else 0, sender.bytes_sent)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request here and its transfer (the decode side frees its reservation)."""
        def stop(engine: object) -> None:
            self._remember_abort(request_id)
            self.loop.abort(request_id)
        self.loop.call(stop)  # NOTE: blocks until the current step ends: call it off the event loop
        sender = self._senders.pop(request_id, None)
        if sender is not None:
            sender.abort(reason)


def _set(fut: asyncio.Future[tuple[RequestOutput, float, float, float]],
         value: tuple[RequestOutput, float, float, float]) -> None:
    if not fut.done():
        fut.set_result(value)
