"""PrefillWorker: runs prompts, samples the first token, ships the KV layer by layer to a decode worker.

Life of a request on a prefill worker (each step is a method of `PrefillRun`, in this order):
1. `handshake`: the decode worker's KV endpoint reserves blocks and says how many leading blocks it already
   caches; only the rest will be sent;
2. `join_batch`: the prompt joins this engine's batch (chunked prefill under the token budget, prefix cache hits
   skipped), overlapping the handshake; each layer's KV is handed to the sender as soon as it is written
   (`on_layer`), and moves while the next layers compute, once the handshake has answered: layers written before
   that wait for it (prefill_workers/held_layers.py), on the host until the step's end;
3. `first_token`: the first token is sampled (`on_output`): the sender commits it (the decode worker can take the
   request) and the request leaves this engine (its blocks stay in the prefix cache);
4. `hand_off`: once the decode worker confirmed the KV, the result (first token, timings, bytes sent) goes back;
   a request that ended at its first token aborts the transfer instead.
A request the router keeps here instead ("stay": the decode pool's steps are predicted slower) runs whole on this
engine and streams back as a decode worker does (`generate`: cluster/request_stream.py, their one streaming loop):
no handshake, no transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from cluster import tracing
from cluster.delta_server import take_relay
from cluster.logs import REQUEST_ID
from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult
from cluster.request_stream import RequestStream
from cluster.worker import Worker, WorkerSpec
from engine.block_hash import hash_prompt_blocks
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.output import RequestOutput
from kv_transfer.endpoint import open_sender
from kv_transfer.pool import KVPool, pool_tensors
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferError, TransferState
from prefill_workers.held_layers import HeldLayers
from prefill_workers.observe import FirstToken, observe

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    """A prefill-pool worker (plain class; `prefill_workers.actor.PrefillActor` wraps it for Ray)."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        super().__init__(spec, loaded)
        self._senders: dict[str, KVSender] = {}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill one prompt, ship its KV to `req.decode_address`; raises TransferError if the KV did not arrive."""
        results = [r async for r in self.prefill_stream(req)]
        return results[-1]

    async def prefill_stream(self, req: PrefillRequest) -> AsyncGenerator[PrefillResult, None]:
        """As `prefill`, the first token as soon as it is sampled: a first result (`handed_off` False) before the
        KV is confirmed, then the final one (raises TransferError if the KV did not arrive). A request that ended
        at its first token has only the final one. What a router reads over the delta channel."""
        REQUEST_ID.set(req.request_id)
        run = PrefillRun(self, req)
        self._senders[req.request_id] = run.sender  # NOTE: before the handshake, so an abort reaches the sender
        # NOTE: the KV wire carries no trace context: this span, a child of the router's prefill span through the
        # Ray message, covers the sender from the handshake to the decode worker's confirmation
        transfer = tracing.start("kv_transfer", req.traceparent, **{"pdcluster.decode_address": req.decode_address})
        finished = False
        try:
            await run.handshake_and_join()
            first = await run.first_token()
            if not first.output.finished and not run.relayed:
                # NOTE: before the handshake's answer: the client has its first token while the KV still moves;
                # if the handshake or the transfer then fails, the router continues from the prompt plus this token
                yield run.result(first, handed_off=False)
            await run.answered(send=not first.output.finished)
            await run.hand_off(first)
            finished = True
        finally:
            tracing.end(transfer)
            if not finished:
                await run.settle()
                if not run.sender.state.finished:  # NOTE: cancelled or closed by the router
                    await asyncio.to_thread(self.abort, req.request_id, "cancelled by the router")
            self._senders.pop(req.request_id, None)
        yield run.result(first)

    async def generate(self, req: DecodeRequest) -> AsyncGenerator[Delta, None]:
        """Run a whole request here (`req.token_ids`: the prompt) and stream its tokens; no KV leaves this worker."""
        stream = RequestStream(self, req)
        await stream.start(stream.join_whole)
        async with contextlib.aclosing(stream.deltas()) as deltas:  # NOTE: a caller gone aborts it at once
            async for delta in deltas:
                yield delta

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request here and its transfer (the decode side frees its reservation)."""
        def stop(engine: object) -> None:
            self._remember_abort(request_id)
            self.loop.abort(request_id)
        self.loop.call(stop)  # NOTE: blocks until the current step ends: call it off the event loop
        sender = self._senders.pop(request_id, None)
        if sender is not None:
            sender.abort(reason)


class PrefillRun:
    """One request on a prefill worker, through the four steps of the module's life cycle."""

    def __init__(self, worker: PrefillWorker, req: PrefillRequest) -> None:
        self.worker, self.req = worker, req
        self.arrived = time.monotonic()
        self.request_id = req.request_id
        engine = worker.engine
        self.tokens = engine.tokenize(req.token_ids, self.request_id)
        self.sender = open_sender(worker.spec.transfer, req.decode_address, self.request_id, engine.kv_layout,
                                  self.tokens, len(self.tokens),
                                  hash_prompt_blocks(self.tokens, engine.config.block_size, engine.scope,
                                                     extra_keys=engine.lora_key(req.params.lora, self.request_id)),
                                  sender_id=worker.name, pool=self._pool(engine), lora=req.params.lora or "")
        self.cached_blocks = 0  # leading blocks the decode worker caches: not sent
        self.prepared = False  # the handshake answered (`cached_blocks` is known)
        self.device_computes = engine.config.device != "cpu"  # the forward pass runs on a GPU, not this host's cores
        aio = asyncio.get_running_loop()
        self._first: asyncio.Future[FirstToken] = aio.create_future()
        # NOTE: over the delta channel the first token leaves from the engine thread, in the step's frame
        # (cluster/delta_server.py `Relay`), without waiting for this event loop; `relayed` says it went
        self._relay, self._outlet = take_relay(), worker.outlet(aio)
        self.relayed = False
        # NOTE: a sender that reads the pool takes layers made before the handshake answered (prefill_workers/
        # held_layers.py), so the handshake and the prefill overlap; copying senders keep the handshake first
        self.held = HeldLayers() if self.sender.reads_pool else None
        self._handshake: asyncio.Future[None] | None = None

    def _pool(self, engine: LLMEngine) -> KVPool | None:
        """The engine's KV pool for a sender that reads it by block ids (nixl); None for a TP group whose rank 0
        does not map its followers' pools (CUDA: the sender then takes the engine's copies, `read_kv_layer`, which
        gathers every rank's heads, `reads_pool` being False without a pool)."""
        try:
            pool_tensors(engine)
        except InvalidRequestError:
            return None
        return KVPool(engine, self.worker.loop.between_steps)

    # ---- 1. handshake ------------------------------------------------------------------------------------
    async def handshake(self) -> None:
        await asyncio.to_thread(self._prepare)

    def _prepare(self) -> None:  # a thread of the event loop's pool
        self.cached_blocks = self.sender.prepare()
        self.prepared = True  # NOTE: read by the engine thread (`on_layer`): held layers may go from now on

    async def handshake_and_join(self) -> None:
        """Steps 1 and 2: one after the other, or at once where layers can wait for the handshake."""
        if self.held is None:
            await self.handshake()
            await self.join_batch()
            return
        self._handshake = asyncio.ensure_future(self.handshake())
        await self.join_batch()

    async def answered(self, send: bool = True) -> None:
        """The overlapped handshake answered: send the layers that waited for it (`send` False: a request that
        ended at its first token lets them go); raises what failed the handshake."""
        if self._handshake is None:
            return
        handshake, self._handshake = self._handshake, None
        try:
            await asyncio.shield(handshake)
        except BaseException:
            await asyncio.wait([handshake])  # NOTE: cancelled: the reservation's answer still comes first
            await asyncio.to_thread(self.worker.loop.call, self._let_go)
            raise
        await asyncio.to_thread(self.worker.loop.call, self._flush if send else self._let_go)

    async def settle(self) -> None:
        """A run that did not finish: its handshake's answer is in and the layers it held are let go (the abort
        that follows then frees the decode worker's reservation too)."""
        if self._handshake is not None:
            await asyncio.wait([self._handshake])
            self._handshake = None
        if self.held is not None and self.held.blocks:
            await asyncio.to_thread(self.worker.loop.call, self._let_go)

    def _flush(self, engine: object) -> None:  # between steps
        assert self.held is not None
        self.held.flush(self.worker.engine, self.sender, self.cached_blocks)

    def _let_go(self, engine: object) -> None:  # between steps
        assert self.held is not None
        self.held.release(self.worker.engine)

    # ---- 2. join the batch ---------------------------------------------------------------------------------
    async def join_batch(self) -> None:
        try:
            await self.worker.loop.run_between_steps(self._start)
        except BaseException:
            await self.settle()  # NOTE: aborted once the reservation's answer is in (the abort frees it)
            await asyncio.to_thread(self.sender.abort, "the prefill worker rejected the request")
            raise

    def _start(self, engine: object) -> None:  # the loop thread, between steps
        w, rid = self.worker, self.request_id
        w._check_not_aborted(rid)
        w._track(w.engine.add_request(rid, self.tokens, self.req.params), self.arrived)
        w.engine.watch_layers(rid, self.on_layer)
        w.loop.attach(rid, self.on_output)

    def on_layer(self, layer: int) -> None:
        """Inside the forward pass: copy this layer's blocks out and hand them to the sender (or, to a sender that
        reads the KV pool itself, their block ids)."""
        engine = self.worker.engine
        if self.held is not None and self.held.waiting:
            if not (self.prepared and self.device_computes):  # NOTE: the handshake has not answered yet (or see below)
                self.held.hold(engine, self.request_id, len(self.tokens), layer, self.sender)
                return
            # NOTE: it answered during this forward pass: what waited goes now and this layer after it. Left to the
            # step's end (`answered`), a prompt of one step sends all its layers after the last one is computed.
            # On a GPU only: on the host the sender's work per layer shares the prefill's core and GIL, and it
            # delayed the first token by more than it shortened the first decode gap (BENCHMARKS.md, the request
            # path, session 13)
            self.held.flush(engine, self.sender, self.cached_blocks)
        if self.sender.reads_pool:
            self.sender.send_blocks(layer, engine.kv_block_ids(self.request_id, self.cached_blocks, len(self.tokens)))
            return
        kv = engine.read_kv_layer(self.request_id, layer, self.cached_blocks, num_tokens=len(self.tokens))
        self.sender.send_layer(layer, *kv)

    # ---- 3. the first token --------------------------------------------------------------------------------
    def on_output(self, out: RequestOutput) -> None:
        """The loop thread, under the lock, before the next step: commit the token, leave the engine."""
        # NOTE: nothing here may block (the engine waits): an abort of the transfer is a network call, so it
        # happens in `hand_off`; committing only queues the token for the sender's thread
        now = time.monotonic()
        queue_ms, prefill_ms = self.worker._first_token(self.request_id, now)
        if not out.finished:
            if self.held is not None and self.held.waiting:  # NOTE: goes out after the held layers
                self.held.commit = (out.new_token_ids, out.num_cached_tokens)
            else:
                self.sender.commit(out.new_token_ids, out.num_cached_tokens)
            self.worker.loop.release(self.request_id)  # NOTE: decoding goes on elsewhere; blocks stay cached
        first = FirstToken(out, now, queue_ms, prefill_ms, self.arrived, len(self.tokens))
        if self._relay is not None and not out.finished:
            self._relay.send_at_step_end(self.result(first, handed_off=False), self._outlet)
            self.relayed = True
        self._first.get_loop().call_soon_threadsafe(_set, self._first, first)

    async def first_token(self) -> FirstToken:
        return await self._first

    # ---- 4. hand off ---------------------------------------------------------------------------------------
    async def hand_off(self, first: FirstToken) -> None:
        """Wait until the decode worker holds the KV (or abort the transfer of a request that already ended)."""
        if first.output.finished:
            await asyncio.to_thread(self.sender.abort, "the request finished at its first token")
            return
        state = await asyncio.to_thread(self.sender.wait, self.worker.spec.transfer.deadline_s)
        if state is not TransferState.DONE:
            raise self.sender.error or TransferError("KV transfer did not finish", self.request_id, retryable=True)

    def result(self, first: FirstToken, handed_off: bool = True) -> PrefillResult:
        """The router's result: after the hand-off, or (`handed_off` False) at the first token, its KV still moving."""
        out, sender = first.output, self.sender
        transfer_ms = max(0.0, (sender.finished_at - first.at) * 1e3) if handed_off and not out.finished else 0.0
        if handed_off:
            observe(self.worker, self.req, first, sender, transfer_ms)
        return PrefillResult(self.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                             out.text, len(self.tokens), out.num_cached_tokens, first.queue_ms, first.prefill_ms,
                             transfer_ms, sender.num_blocks if not out.finished else 0, sender.bytes_sent,
                             out.new_logprobs, out.prompt_logprobs, handed_off=handed_off)


def _set(fut: asyncio.Future[FirstToken], value: FirstToken) -> None:
    if not fut.done():
        fut.set_result(value)
