"""Which workers serve a request: prefill by predicted time to first token, decode by load and free KV blocks.

The inputs are shared through Redis (prefix matches, heartbeat loads) plus what this router itself has in
flight, so several routers make consistent choices without talking to each other.

Where the prompt is computed (`Policy.route`):
1. a decode worker that caches all but `skip_max` tokens of the prompt computes the rest itself (prefix rule);
2. else the prompt (the part of it the decode worker does not cache) is computed by the decode worker, in chunks
   beside its decode batch, when the prefill pool's queue alone would delay its first token more than the decode
   worker's whole chunked path: its step in flight, then as many steps as the prompts queued there and this one take
   at the ITL budget per step (`itl_budget`: what `slo_itl_ms` leaves after the decode batch, from the measured step
   cost: the engine's own budget, engine/step_budget.py). The SLO rule. A decode batch that fills its steps takes
   none; with an idle prefill pool the prompt goes to that pool: the decode batch's steps are only lengthened when the
   prefill queue is what makes the user wait;
3. else the prefill worker with the soonest predicted first token: its queue, the prompt's own steps, and the KV
   transfer to the decode worker (`transfer`, fitted on what this router saw);
4. ... where the request stays, whole, when decode is the bottleneck (`stay`): the decode worker's steps with it are
   predicted past `slo_itl_ms` and the prefill worker's shorter, that worker has no prompt queued (once it decodes,
   its engine caps its prompt chunks to the ITL budget) and the first token is not later there: no transfer, and a
   prompt that prefill worker caches is served from its cache.
Times come from the workers' measured step costs in their heartbeats (`WorkerLoad.step_base_us`, `step_token_ns`),
with priors (and the router's own measure of each worker's prefill speed) until a worker has measured a few steps
(cluster/worker_metrics.py: MIN_REPORTED_STEPS).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from cluster.messages import WorkerLoad
from cluster.worker_metrics import PRIOR_STEP_BASE_S, LinearCost
from engine.step_budget import STARVED_STEPS_MAX

DEFAULT_PREFILL_TOK_S = 2000.0  # until a worker's own speed is measured
PREFIX_WEIGHT = 0.5  # decode choice: a fully cached prompt is worth this fraction of a worker's batch of load
# NOTE: the KV transfer's tail after the last layer is computed (prior until the router saw transfers): a few ms
# of handshake and commit, plus ~50 µs per token (SmolLM2 float32 KV is ~92 KB per token, over local gRPC)
PRIOR_TRANSFER_BASE_S = 0.005
PRIOR_TRANSFER_TOKEN_S = 0.00005


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

    # ---- predicted step times ------------------------------------------------------------------------------
    def step_cost(self) -> tuple[float, float]:
        """(fixed s, s per token) of one engine step: measured by the worker, else this router's prefill speed."""
        if self.load is not None and self.load.step_token_ns > 0:
            return self.load.step_base_us / 1e6, self.load.step_token_ns / 1e9
        return PRIOR_STEP_BASE_S, 1.0 / self.prefill_tok_s

    def step_s(self, tokens: float, steps: int = 1) -> float:
        """Seconds for `tokens` computed in `steps` engine steps."""
        base, per_token = self.step_cost()
        return steps * base + tokens * per_token

    def step_limit(self) -> int:
        """Tokens one step computes at most (0: not known)."""
        return self.load.max_num_batched_tokens if self.load else 0

    def decode_batch(self) -> int:
        """Decode tokens in each of its steps: running sequences and transfers about to join them (or this router's
        requests there, when more: the heartbeat is up to half a second old)."""
        return max(self.load.running + self.load.reserved if self.load else 0, self.inflight)


@dataclass
class Route:
    """The choice for one request; `prefill` None means the decode worker runs the whole request."""

    prefill: str | None
    decode: str
    predicted_ttft_ms: float
    # prefill None: "prefix" (decode caches it), "slo" (the prefill queue), "no_prefill" (none up), "stay" (`decode`
    # is a prefill worker: decode is the bottleneck)
    why: str = ""
    decode_prefill_tokens: int = 0  # prefill None: the prompt tokens the `decode` worker computes


class Policy:
    """`prefix_aware` (predicted TTFT, prefix matches, SLO rule) or `round_robin` (the baseline for comparisons)."""

    def __init__(self, routing: str, block_size: int, skip_prefill_max_uncached_tokens: int,
                 slo_itl_ms: float | None = None) -> None:
        self.routing = routing
        self.block_size = block_size
        self.skip_max = skip_prefill_max_uncached_tokens
        self.slo_itl_s = slo_itl_ms / 1e3 if slo_itl_ms else None  # None: the SLO rule is off
        self.transfer = LinearCost(PRIOR_TRANSFER_BASE_S, PRIOR_TRANSFER_TOKEN_S)  # KV tail after the last layer
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()

    def route(self, prompt_len: int, max_tokens: int, matched: dict[str, int], prefill: list[WorkerView],
              decode: list[WorkerView]) -> Route:
        """Pick the workers; `matched` is how many leading prompt blocks each worker caches (prefix index)."""
        if not decode:
            raise ValueError("no decode workers")
        decode_pick = self.pick_decode(prompt_len, max_tokens, matched, decode)
        uncached = prompt_len - min(prompt_len, matched.get(decode_pick.name, 0) * self.block_size)
        if not prefill:
            return Route(None, decode_pick.name, self.decode_ttft_s(decode_pick, uncached) * 1e3, "no_prefill",
                         uncached)
        if self.routing == "round_robin":
            prefill_pick = prefill[next(self._rr_prefill) % len(prefill)]
            return Route(prefill_pick.name, decode_pick.name, self._ttft(prefill_pick, prompt_len, matched))
        # NOTE: only a prompt the decode worker already caches in part skips the prefill pool on the prefix rule
        if uncached < prompt_len and uncached <= self.skip_max:
            return Route(None, decode_pick.name, self.decode_ttft_s(decode_pick, uncached) * 1e3, "prefix", uncached)
        start = next(self._rr_prefill)  # NOTE: rotating the tie order spreads equal-cost requests over workers
        order = prefill[start % len(prefill):] + prefill[: start % len(prefill)]
        prefill_pick = min(order, key=lambda w: (self._ttft(w, prompt_len, matched), w.inflight))
        ttft_ms = self._ttft(prefill_pick, prompt_len, matched)
        if 0 < uncached and self.itl_budget(decode_pick) > 0:
            own = self._uncached(prefill_pick, prompt_len, matched)
            queue_s = self.prefill_s(prefill_pick, own) - self.prefill_s(prefill_pick, own, queued=0)
            decode_s = self.decode_ttft_s(decode_pick, uncached)
            if queue_s > decode_s:
                return Route(None, decode_pick.name, decode_s * 1e3, "slo", uncached)
        stay = self._stay(prefill_pick, decode_pick, prompt_len, max_tokens, matched)
        return stay or Route(prefill_pick.name, decode_pick.name, ttft_ms)

    def _stay(self, p: WorkerView, d: WorkerView, prompt_len: int, max_tokens: int,
              matched: dict[str, int]) -> Route | None:
        """The whole request on prefill worker `p` when decode worker `d` is the bottleneck, else None."""
        if self.slo_itl_s is None:
            return None
        decode_itl = self.itl_s(d)
        if decode_itl <= self.slo_itl_s or self.itl_s(p) >= decode_itl:
            return None
        need = -(-(prompt_len + max_tokens) // self.block_size) - matched.get(p.name, 0)
        # NOTE: only a prefill worker with no prompt work queued: once it decodes, its engine caps its prompt chunks
        # to the ITL budget, which would slow every first token queued there
        if p.free_blocks() < need or p.busy() >= 1 or p.queued_tokens() > 0:
            return None
        own = self._uncached(p, prompt_len, matched)
        ttft_s = self.decode_ttft_s(p, own)
        # NOTE: only when its own first token is not later for it (its prompt shares the steps with what p decodes);
        # compared as the prefill path is predicted: without the step in flight
        if (ttft_s - self.in_flight_s(p)) * 1e3 > self._ttft(p, prompt_len, matched):
            return None
        return Route(None, p.name, ttft_s * 1e3, "stay", own)

    def itl_s(self, w: WorkerView) -> float:
        """Predicted gap between two tokens of a request that joins worker `w`'s decode batch: its steps then, with
        the prompt tokens its engine still takes beside that batch (within the ITL budget, engine/step_budget.py)."""
        batch = w.decode_batch() + 1
        base, per_token = w.step_cost()
        room = float((w.step_limit() or 1 << 30) - batch)
        if self.slo_itl_s is not None:
            room = min(room, math.floor((self.slo_itl_s - base) / per_token) - batch)
        return w.step_s(batch + min(w.queued_tokens(), max(0.0, room)))

    def pick_prefill(self, prompt_len: int, prefill: list[WorkerView]) -> WorkerView:
        """A prefill worker on load alone (a retry after a failure): the soonest predicted first token."""
        return min(prefill, key=lambda w: (self._ttft(w, prompt_len, {}), w.inflight))

    # ---- predictions ---------------------------------------------------------------------------------------
    def _uncached(self, w: WorkerView, prompt_len: int, matched: dict[str, int]) -> int:
        return max(1, prompt_len - matched.get(w.name, 0) * self.block_size)

    def _ttft(self, w: WorkerView, prompt_len: int, matched: dict[str, int]) -> float:
        """Predicted first token (ms) through prefill worker `w`: its queue, the prompt's steps, the KV transfer."""
        return (self.prefill_s(w, self._uncached(w, prompt_len, matched)) + self.transfer.predict(prompt_len)) * 1e3

    def prefill_s(self, w: WorkerView, tokens: int, queued: float | None = None) -> float:
        """Seconds until prefill worker `w` has computed a new prompt's `tokens` behind its queue (`queued` tokens,
        default its current queue).

        NOTE: with `shortest_first` a short prompt waits only for the step in flight, then shares its own step
        with the queue's next tokens; first come first served, it waits for the whole queue.
        """
        q = w.queued_tokens() if queued is None else queued
        limit = w.step_limit() or int(q) + tokens  # not known: as one step
        if w.load is not None and w.load.shortest_first and q > 0:
            ahead = min(q, limit)
            total = ahead + tokens + min(q - ahead, max(0, limit - tokens))
        else:
            total = q + tokens
        return w.step_s(total, math.ceil(total / limit))

    def decode_ttft_s(self, d: WorkerView, tokens: int) -> float:
        """Seconds until decode worker `d` has computed `tokens` prompt tokens: its step in flight, then the steps that
        take the prompts queued there and this one, `chunk_tokens` at a time, each beside its decode batch."""
        batch, q = d.decode_batch(), d.queued_tokens()
        in_flight, chunk = self.in_flight_s(d), self.chunk_tokens(d)
        work = q + tokens
        steps = max(1, math.ceil(work / chunk))
        if batch and self.slo_itl_s is not None and not self.itl_budget(d):
            steps += STARVED_STEPS_MAX  # NOTE: decode fills its steps: prompt work waits that long, then a block a step
        return in_flight + d.step_s(steps * batch + work, steps)

    def in_flight_s(self, d: WorkerView) -> float:
        """Seconds of worker `d`'s step in flight (its decode batch and the prompt chunk beside it; 0: idle)."""
        batch, q = d.decode_batch(), d.queued_tokens()
        return d.step_s(batch + min(q, self.chunk_tokens(d))) if batch or q else 0.0

    def itl_budget(self, d: WorkerView) -> int:
        """Prompt tokens one step of decode worker `d` takes beside its decode batch within the ITL SLO (0: none)."""
        if self.slo_itl_s is None:
            return 0
        base, per_token = d.step_cost()
        room = (self.slo_itl_s - base) / per_token - d.decode_batch()
        if d.step_limit():
            room = min(room, d.step_limit() - d.decode_batch())
        return max(0, math.floor(room))

    def chunk_tokens(self, d: WorkerView) -> int:
        """Prompt tokens per step decode worker `d`'s engine computes (engine/step_budget.py): a whole step while
        nothing decodes, else its ITL budget, and one block when that is none (after STARVED_STEPS_MAX steps)."""
        batch, limit = d.decode_batch(), d.step_limit() or 1 << 30
        if batch == 0 or self.slo_itl_s is None:
            return max(1, limit - batch)
        return self.itl_budget(d) or self.block_size

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
