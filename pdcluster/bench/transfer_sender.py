"""The sending side of `bench transfer`: a 1-thread prefill engine, fresh prompts, and timed transfers.

It drives a sender the way a prefill worker does (open_sender → prepare → send_layer per layer → commit → wait),
with layers read by `LLMEngine.read_kv_layer` during the prefill step (layer-wise) or right after it. Every
transfer it times ends DONE with the receiver holding exactly the KV sent (CRC over every layer), or the bench
stops with a BenchError naming the transport, the request and the reason.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.bench.transfer_peers import BenchError, Layers, ReceiverPeer, bench_engine_config, cpu_seconds, kv_crc

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from kv_transfer import KVSender, TransferConfig

DEADLINE_S = 60.0  # per transfer; the layer-wise one includes a whole prefill


@dataclass
class Payload:
    """One prefilled prompt's KV as the sender hands it on, and what it commits after it."""

    prompt: list[int]
    first_token_ids: list[int]
    layers: Layers
    crc: int
    block_ids: list[int]  # the prompt's blocks in the sender's pool, pinned there (nixl sends from them)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers for t in kv)


@dataclass
class Timing:
    """One timed send: wall seconds, and CPU seconds of each end's process (receiver: None if not measurable)."""

    seconds: float
    sender_cpu_s: float
    receiver_cpu_s: float | None  # NOTE: None for `local` (its receiver runs in the sender's process)


def cpu_since(start: tuple[float | None, float | None], pid: int | None) -> tuple[float, float | None]:
    """CPU seconds this process and process `pid` used since `start` (as `cpu_seconds` read them)."""
    mine, theirs = cpu_seconds(), cpu_seconds(pid) if pid is not None else None
    assert mine is not None and start[0] is not None
    return mine - start[0], theirs - start[1] if theirs is not None and start[1] is not None else None


class PrefillSender:
    """The prefill side: a 1-thread prefill engine, fresh random prompts, and timed sends to one peer."""

    def __init__(self, loaded: LoadedModel, tokens: int, num_blocks: int, kv_cache_dtype: str = "auto",
                 tp: int = 1) -> None:
        from engine import LLMEngine

        self.engine = LLMEngine(loaded, bench_engine_config(num_blocks, max(2048, tokens), kv_cache_dtype, tp))
        self.tokens = tokens
        self.sender_id = f"bench-{os.getpid()}"
        self._gen = torch.Generator().manual_seed(0)
        self._ids = itertools.count()

    def rid(self, what: str) -> str:
        """A request id never used before in this run."""
        return f"{what}-{next(self._ids)}"

    def prompt(self) -> list[int]:
        """A fresh random prompt of `tokens` ids (nothing of it is cached anywhere)."""
        return torch.randint(100, self.engine.model_config.vocab_size, (self.tokens,), generator=self._gen).tolist()

    def prefill(self, rid: str, prompt: list[int], watch: Callable[[int], None] | None = None) -> list[int]:
        """Run one prompt to its first token (one step: the batch budget covers it); its token ids.

        The request asked for two tokens, so it stays in the batch (its KV readable) until `release`.
        """
        from engine import SamplingParams

        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0))
        if watch is not None:
            self.engine.watch_layers(rid, watch)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    return out.token_ids

    def release(self, rid: str) -> None:
        """The request leaves this engine after its first token, as on a prefill worker."""
        self.engine.abort_request(rid)

    def read_layers(self, rid: str, skip_blocks: int = 0) -> Layers:
        """Copies of every layer's K and V of the prompt's blocks from `skip_blocks` on."""
        return [self.engine.read_kv_layer(rid, layer, skip_blocks, num_tokens=self.tokens)
                for layer in range(self.engine.kv_layout.num_layers)]

    def payload(self) -> Payload:
        """A fresh prompt prefilled, its layers read as they are computed (and released; its blocks stay pinned)."""
        prompt, rid = self.prompt(), self.rid("payload")
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        first = self.prefill(rid, prompt, lambda layer: layers.append(
            self.engine.read_kv_layer(rid, layer, 0, num_tokens=self.tokens)))
        block_ids = self.engine.kv_block_ids(rid, 0, self.tokens)
        self.engine.pin_kv_blocks(block_ids)
        self.release(rid)
        return Payload(prompt, first, layers, kv_crc(layers), block_ids)

    def open(self, tc: TransferConfig, peer: ReceiverPeer, rid: str, prompt: list[int]) -> KVSender:
        from engine.block_hash import hash_prompt_blocks
        from kv_transfer import open_sender
        from kv_transfer.pool import KVPool

        hashes = [bytes(h) for h in hash_prompt_blocks(prompt, self.engine.config.block_size, self.engine.scope)]
        return open_sender(tc, peer.address, rid, self.engine.kv_layout, prompt, len(prompt), hashes,
                           sender_id=self.sender_id, pool=KVPool(self.engine))

    def prepare(self, sender: KVSender) -> int:
        from kv_transfer import TransferError

        try:
            cached = sender.prepare()
        except TransferError as e:
            raise BenchError(f"{sender.transport} handshake of {sender.request_id} failed: {e}") from None
        if cached:
            raise BenchError(f"{sender.transport}: receiver caches {cached} blocks of {sender.request_id}; "
                             "prefix caching should be off there")
        return cached

    def finish(self, sender: KVSender, peer: ReceiverPeer, want_crc: int) -> None:
        """The transfer must be DONE, and the receiver must hold exactly the KV sent; then it frees it."""
        from kv_transfer import TransferState

        state = sender.wait(DEADLINE_S)
        if state is not TransferState.DONE:
            reason = sender.error.reason if sender.error else "no error recorded"
            raise BenchError(f"{sender.transport} transfer of {sender.request_id} ended {state.value}: {reason}")
        answer = peer.ask(sender.request_id)
        if answer[0] != "done":
            raise BenchError(f"{sender.transport} transfer of {sender.request_id}: {answer[1]}")
        if answer[1] != want_crc:
            raise BenchError(f"{sender.transport} transfer of {sender.request_id}: the receiver's KV differs from "
                             f"the sender's (crc {answer[1]:#x} != {want_crc:#x})")

    def send(self, tc: TransferConfig, peer: ReceiverPeer, payload: Payload) -> Timing:
        """Seconds for open_sender → prepare → send_layer of every layer → commit → DONE of a prefilled payload."""
        rid = self.rid(tc.transport)
        cpu0 = (cpu_seconds(), cpu_seconds(peer.pid) if peer.pid is not None else None)
        t0 = time.perf_counter()
        sender = self.open(tc, peer, rid, payload.prompt)
        self.prepare(sender)
        for layer, (k, v) in enumerate(payload.layers):
            if sender.reads_pool:  # nixl: from the pool's blocks, as a prefill worker hands them
                sender.send_blocks(layer, payload.block_ids)
            else:
                sender.send_layer(layer, k, v)
        sender.commit(payload.first_token_ids)
        sender.wait(DEADLINE_S)
        timing = Timing(time.perf_counter() - t0, *cpu_since(cpu0, peer.pid))
        self.finish(sender, peer, payload.crc)
        return timing

    def prefill_alone(self) -> float:
        prompt, rid = self.prompt(), self.rid("prefill")
        t0 = time.perf_counter()
        self.prefill(rid, prompt)
        seconds = time.perf_counter() - t0
        self.release(rid)
        return seconds

    def sequential(self, tc: TransferConfig, peer: ReceiverPeer) -> dict[str, float]:
        """Prefill, then handshake, read every layer and send it, commit; timed until DONE."""
        prompt, rid = self.prompt(), self.rid(f"{tc.transport}-seq")
        t0 = time.perf_counter()
        first = self.prefill(rid, prompt)
        t_prefill = time.perf_counter() - t0
        sender = self.open(tc, peer, rid, prompt)
        cached = self.prepare(sender)
        layers = self.read_layers(rid, cached)
        for layer, (k, v) in enumerate(layers):
            if sender.reads_pool:
                sender.send_blocks(layer, self.engine.kv_block_ids(rid, cached, self.tokens))
            else:
                sender.send_layer(layer, k, v)
        sender.commit(first)
        sender.wait(DEADLINE_S)
        total = time.perf_counter() - t0
        self.release(rid)
        self.finish(sender, peer, kv_crc(layers))
        return {"sequential_s": total, "sequential_prefill_s": t_prefill, "sequential_tail_s": total - t_prefill}

    def layerwise(self, tc: TransferConfig, peer: ReceiverPeer) -> dict[str, float]:
        """Handshake, then prefill sending each layer as soon as it is written, commit; timed until DONE."""
        prompt, rid, n = self.prompt(), self.rid(f"{tc.transport}-lw"), self.tokens
        engine = self.engine
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        t0 = time.perf_counter()
        sender = self.open(tc, peer, rid, prompt)
        cached = self.prepare(sender)

        def on_layer(layer: int) -> None:  # what the prefill worker's hook does (the copy is kept for the CRC)
            layers.append(engine.read_kv_layer(rid, layer, cached, num_tokens=n))
            if sender.reads_pool:
                sender.send_blocks(layer, engine.kv_block_ids(rid, cached, n))
            else:
                sender.send_layer(layer, *layers[-1])

        token_ids = self.prefill(rid, prompt, on_layer)
        t_prefill = time.perf_counter() - t0
        sender.commit(token_ids)
        sender.wait(DEADLINE_S)
        total = time.perf_counter() - t0
        self.release(rid)
        self.finish(sender, peer, kv_crc(layers))
        return {"layerwise_s": total, "layerwise_prefill_s": t_prefill, "layerwise_tail_s": total - t_prefill}

    def overlap(self, tc: TransferConfig, peer: ReceiverPeer, rounds: int) -> dict[str, Any]:
        """T_p, T_seq, T_lw (medians over `rounds`, order alternating against drift) and what they say."""
        runs: list[dict[str, float]] = []
        for r in range(rounds):
            steps = [lambda: {"prefill_s": self.prefill_alone()}, lambda: self.sequential(tc, peer),
                     lambda: self.layerwise(tc, peer)]
            run: dict[str, float] = {}
            for step in steps if r % 2 == 0 else steps[::-1]:
                run |= step()
            runs.append(run)
        o: dict[str, Any] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        o["transfer_s"] = t_x = o["sequential_s"] - o["prefill_s"]
        o["overlap"] = (o["sequential_s"] - o["layerwise_s"]) / t_x if t_x > 0 else None
        o["tail_hidden"] = 1 - o["layerwise_tail_s"] / o["sequential_tail_s"]
        # NOTE: prefills without sending (alone, and the first part of the sequential run) show the timing noise
        clean = [run[k] for run in runs for k in ("prefill_s", "sequential_prefill_s")]
        o["prefill_spread_s"] = max(clean) - min(clean)
        o["runs"] = runs
        return o
