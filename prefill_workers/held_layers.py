"""Layers a prefill computed before its decode worker's reservation answered: held, their blocks pinned, until then.

NOTE: the handshake (the decode worker reserves blocks between two of its steps) and the prefill run at once, as
the issue of a first token's path asks: the handshake no longer comes before the prompt joins the batch. A layer
written before the handshake answers cannot be sent (the decode side's block ids and the blocks it already caches
are not known yet), so it waits here with a mark of when it was written (a GPU event); the prompt's blocks are
pinned meanwhile (the request may leave the engine at its first token, before the answer). `flush` sends the held
layers' blocks past the cached ones and the first token's commit, and lets the pins go (the sender pins what it
sends): from the engine thread inside the forward pass, at the first layer after the answer came (so the rest of the
prompt's layers go out as they are computed), or between two steps when the answer came after the prefill. Only
senders that read the KV pool themselves (nixl) hold layers; copying transports (grpc, torch) copy inside the
forward pass and keep the handshake first.
"""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from kv_transfer.sender import KVSender


class HeldLayers:
    """One request's layers and commit waiting for the handshake (touched only under the engine lock)."""

    def __init__(self) -> None:
        self.waiting = True  # the handshake has not answered (or not been flushed) yet
        self.layers: list[tuple[int, object]] = []  # (layer, the sender's mark of when it was written)
        self.blocks: list[int] = []  # every block of the prompt, pinned while layers wait
        self.commit: tuple[list[int], int] | None = None  # the first token's commit, made before the answer

    def hold(self, engine: LLMEngine, request_id: str, num_tokens: int, layer: int, sender: KVSender) -> None:
        """(inside the forward pass) keep `layer` for later; the first one pins the prompt's blocks."""
        if not self.blocks:
            self.blocks = engine.kv_block_ids(request_id, 0, num_tokens)
            engine.pin_kv_blocks(self.blocks)
        self.layers.append((layer, sender.layer_mark()))

    def flush(self, engine: LLMEngine, sender: KVSender, cached_blocks: int) -> None:
        """(the handshake answered; inside a forward pass or between steps) send what waited; from now on layers go
        straight out. Again after that: nothing left to send."""
        self.waiting = False
        for layer, mark in self.layers:
            sender.send_blocks(layer, self.blocks[cached_blocks:], ready=mark)
        if self.commit is not None:
            sender.commit(*self.commit)
        self.release(engine)

    def release(self, engine: LLMEngine) -> None:
        """(between steps) let the pins go (after `flush`, or when the transfer failed)."""
        self.waiting = False
        self.layers, self.commit = [], None
        if self.blocks:
            engine.unpin_kv_blocks(self.blocks)
            self.blocks = []
