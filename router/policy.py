"""Which workers serve a request: prefill by predicted time to first token, decode by load and free KV blocks.

The inputs are shared through Redis (prefix matches, heartbeat loads) plus what this router itself has in
flight, so several routers make consistent choices without talking to each other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cluster.messages import WorkerLoad

DEFAULT_PREFILL_TOK_S = 2000.0  # until a worker's own speed is measured
PREFIX_WEIGHT = 0.5  # decode choice: a fully cached prompt is worth this fraction of a worker's batch of load


@dataclass
class WorkerView:
    """What the router knows about one worker."""

    name: str
    num_blocks: int
    max_num_seqs: int
    load: WorkerLoad | None = None  # last heartbeat (all routers see it); None: none seen yet
    inflight: int = 0  # this router's requests on the worker now
    pending_tokens: int = 0  # this router's prompt tokens waiting for prefill there
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S  # measured prefill speed (exponential moving average)

    def queued_tokens(self) -> float:
        return float(max(self.load.pending_prefill_tokens if self.load else 0, self.pending_tokens))

    def busy(self) -> float:
        """Requests on the worker, as a fraction of its batch."""
        shared = self.load.running + self.load.waiting if self.load else 0
        return max(shared, float(self.inflight)) / max(1, self.max_num_seqs)

    def free_blocks(self) -> float:
        return float(self.load.free_blocks if self.load else self.num_blocks)

    def observe_prefill(self, tokens: int, ms: float) -> None:
        if tokens > 0 and ms > 0:
            self.prefill_tok_s = 0.8 * self.prefill_tok_s + 0.2 * tokens / (ms / 1e3)


@dataclass
class Route:
    """The choice for one request; `prefill` None means the decode worker runs the whole request."""

    prefill: str | None
    decode: str
    predicted_ttft_ms: float


class Policy:
    """`prefix_aware` (predicted TTFT, prefix matches) or `round_robin` (the baseline for comparisons)."""

    def __init__(self, routing: str, block_size: int, skip_prefill_max_uncached_tokens: int) -> None:
        self.routing = routing
        self.block_size = block_size
        self.skip_max = skip_prefill_max_uncached_tokens
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()

    def route(self, prompt_len: int, max_tokens: int, matched: dict[str, int], prefill: list[WorkerView],
              decode: list[WorkerView]) -> Route:
        """Pick the workers; `matched` is how many leading prompt blocks each worker caches (prefix index)."""
        if not decode:
            raise ValueError("no decode workers")
        decode_pick = self.pick_decode(prompt_len, max_tokens, matched, decode)
        cached_on_decode = min(prompt_len, matched.get(decode_pick.name, 0) * self.block_size)
        uncached_on_decode = prompt_len - cached_on_decode
        # NOTE: only a prompt the decode worker already caches in part skips the prefill pool; a short uncached
        # prompt still goes to prefill, so decode steps never wait behind prompt computation.
        skip = self.routing == "prefix_aware" and cached_on_decode > 0 and uncached_on_decode <= self.skip_max
        if not prefill or skip:
            ttft = (decode_pick.queued_tokens() + uncached_on_decode) / decode_pick.prefill_tok_s * 1e3
            return Route(None, decode_pick.name, ttft)
        if self.routing == "round_robin":
            prefill_pick = prefill[next(self._rr_prefill) % len(prefill)]
            return Route(prefill_pick.name, decode_pick.name, self._ttft(prefill_pick, prompt_len, matched))
        start = next(self._rr_prefill)  # NOTE: rotating the tie order spreads equal-cost requests over workers
        order = prefill[start % len(prefill):] + prefill[: start % len(prefill)]
        prefill_pick = min(order, key=lambda w: (self._ttft(w, prompt_len, matched), w.inflight))
        return Route(prefill_pick.name, decode_pick.name, self._ttft(prefill_pick, prompt_len, matched))

    def pick_prefill(self, prompt_len: int, prefill: list[WorkerView]) -> WorkerView:
        """A prefill worker on load alone (a retry after a failure): the soonest predicted first token."""
        return min(prefill, key=lambda w: (self._ttft(w, prompt_len, {}), w.inflight))

    def _ttft(self, w: WorkerView, prompt_len: int, matched: dict[str, int]) -> float:
        uncached = max(1, prompt_len - matched.get(w.name, 0) * self.block_size)
        return (w.queued_tokens() + uncached) / w.prefill_tok_s * 1e3

    def pick_decode(self, prompt_len: int, max_tokens: int, matched: dict[str, int],
                    decode: list[WorkerView]) -> WorkerView:
        """The decode worker for a request: least busy among those with room, a cached prefix counting."""
        if self.routing == "round_robin":
            return decode[next(self._rr_decode) % len(decode)]
        need = -(-(prompt_len + max_tokens) // self.block_size)
        fits = [w for w in decode if w.free_blocks() >= need - matched.get(w.name, 0)] or decode
        start = next(self._rr_decode)
        order = fits[start % len(fits):] + fits[: start % len(fits)]

        def score(w: WorkerView) -> float:
            cached_frac = matched.get(w.name, 0) * self.block_size / max(1, prompt_len)
            return w.busy() - PREFIX_WEIGHT * cached_frac
        return min(order, key=score)
