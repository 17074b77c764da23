"""The handoff on a decode worker: a request's stream waits here for its KV and starts decoding the moment it lands.

NOTE: the router opens a request's decode stream together with its prefill (as SGLang's load balancer sends a
request to its prefill and decode servers at once), so the decode worker has the sampling params before the KV
arrives: it takes the transfer into its batch when the prefill worker commits, with no round trip through the
router in between. A stream whose transfer fails, or that is aborted while it waits, ends without a token.
"""

from __future__ import annotations

import asyncio
import threading

from engine.output import stop_holdback
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kv_transfer.state import TransferState


def first_token_chars(tokenizer: Tokenizer, token_ids: list[int], params: SamplingParams) -> int:
    """How many characters of the first token's text the prefill worker streamed (it held back the rest).

    NOTE: what engine/output.py emits for a request's first output token that does not finish it: its text less
    the characters a stop string could still need. Both engines run the same detokenizer on the same tokens, so
    the decode worker knows this without being told; it reports the number back (`Delta.resumed_chars`) and the
    router, which has the prefill worker's own text, fails the stream over should the two ever differ.
    """
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
    for tok in token_ids:
        detok.add(tok)
    return max(0, len(detok.text) - stop_holdback(params))


class KVWaiters:
    """Streams waiting for their request's transfer; the receiver's `on_settled` and aborts wake them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = {}

    def register(self, request_id: str) -> asyncio.Future[bool]:
        """A future that becomes True when the request's KV is DONE, False when it failed or was aborted."""
        aio = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = aio.create_future()
        with self._lock:
            self._waiting[request_id] = (aio, fut)
        return fut

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def settled(self, request_id: str, state: TransferState) -> None:
        """The receiver's hook (any thread): the transfer of `request_id` is DONE or FAILED."""
        self.wake(request_id, state is TransferState.DONE)

    def wake(self, request_id: str, ok: bool) -> None:
        with self._lock:
            waiter = self._waiting.get(request_id)
        if waiter is not None:
            aio, fut = waiter
            aio.call_soon_threadsafe(_resolve, fut, ok)


def _resolve(fut: asyncio.Future[bool], ok: bool) -> None:
    if not fut.done():
        fut.set_result(ok)
