"""Admission: the slot count (`check_slots`), a slot held from before a request is read (`Admission`), and a
routed request's deadline and predicted first token (`check_route`).

NOTE: the expensive work of a request (its body, its tokens) happens inside the admission limit, and a request
refused for its deadline is told why: DEADLINE_EXCEEDED when even an idle cluster could not meet it (retrying it
fails again), RESOURCE_EXHAUSTED when the queue ahead is the cause (clients back off and retry).
"""

from __future__ import annotations

import math
from typing import Protocol

from router.errors import DeadlineExceeded, Overloaded
from router.metrics import RouterMetrics
from router.policy import Route
from router.pools import WorkerPools


class HasPending(Protocol):
    pending: int  # requests admitted and still being read or tokenized


class Admission:
    """An admission slot taken before a request is read, parsed or tokenized; `Router.stream` takes it over.

    NOTE: the expensive work of a request (its body, its tokens) happens inside the admission limit: 300 clients
    sending megabyte prompts at once get RESOURCE_EXHAUSTED for all but `max_inflight` of them, instead of all
    of them queueing their tokenizing ahead of everyone's.
    """

    def __init__(self, router: HasPending) -> None:
        self.router, self.held = router, True

    def release(self) -> None:
        """Give the slot back (again: nothing)."""
        if self.held:
            self.held = False
            self.router.pending -= 1


def check_slots(taken: int, limit: int, request_id: str | None, metrics: RouterMetrics) -> None:
    """Refuse (RESOURCE_EXHAUSTED) a request when `taken` slots (in flight or being admitted) reach `limit`."""
    if taken >= limit:
        metrics.rejected("inflight")
        raise Overloaded(f"the router has {taken} requests in flight (router.max_inflight)", request_id)


def check_route(pools: WorkerPools, route: Route, prompt_len: int, matched: dict[str, int], left_s: float | None,
                limit_ms: float, request_id: str, metrics: RouterMetrics) -> None:
    """Refuse a routed request that cannot meet its deadline (`left_s` from now; None: it has none) or whose first
    token is predicted past the admission limit (`limit_ms`, router.max_predicted_ttft_ms; 0: none)."""
    if left_s is not None:
        # NOTE: before the admission limit: a deadline that even an idle cluster cannot meet is DEADLINE_EXCEEDED
        # however busy the cluster is (a 429 would invite a retry that fails again)
        check_reachable(pools, route, prompt_len, matched, left_s, request_id, metrics)
    if limit_ms and route.predicted_ttft_ms > limit_ms:
        # NOTE: refused, not queued: the backlog is on the workers already, and a request admitted past it waits
        # behind it while holding a decode reservation; 429 lets the client back off or go elsewhere
        metrics.rejected("backlog")
        raise Overloaded(f"the first token is predicted in {route.predicted_ttft_ms / 1e3:.1f} s, past the admission "
                         f"limit of {limit_ms / 1e3:.1f} s (router.max_predicted_ttft_ms): the prefill backlog is too "
                         "long", request_id)
    if left_s is not None:
        check_in_time(route, left_s, request_id, metrics)


def check_reachable(pools: WorkerPools, route: Route, prompt_len: int, matched: dict[str, int], left_s: float,
                    request_id: str, metrics: RouterMetrics) -> None:
    """Refuse (DEADLINE_EXCEEDED) a request whose first token would come past its deadline (`left_s` from now) even
    on an idle cluster: checked before any load-based refusal, since retrying it fails again."""
    unloaded_s = unloaded_ttft_s(pools, route, prompt_len, matched)
    if left_s <= 0 or unloaded_s > left_s:
        metrics.rejected("deadline")
        raise DeadlineExceeded(f"the request's deadline ({max(0.0, left_s) * 1e3:.0f} ms left) is shorter than its "
                               f"first token takes on an idle cluster (~{unloaded_s * 1e3:.0f} ms)", request_id)


def check_in_time(route: Route, left_s: float, request_id: str, metrics: RouterMetrics) -> None:
    """Refuse (RESOURCE_EXHAUSTED) a request whose first token is predicted past its deadline with what is queued."""
    if route.predicted_ttft_ms / 1e3 > left_s:
        metrics.rejected("deadline")
        raise Overloaded(f"the first token is predicted in {route.predicted_ttft_ms / 1e3:.1f} s, past the "
                         f"request's deadline ({left_s:.1f} s left): the cluster is too busy", request_id)


def unloaded_ttft_s(pools: WorkerPools, route: Route, prompt_len: int, matched: dict[str, int]) -> float:
    """The route's predicted first token with nothing queued ahead: the prompt's own steps (and KV transfer)."""
    policy = pools.policy
    if route.prefill is None:
        view, tokens = pools[route.decode].view, max(1, route.decode_prefill_tokens)
        return view.step_s(tokens, math.ceil(tokens / (view.step_limit() or tokens)))
    view = pools[route.prefill].view
    tokens = max(1, prompt_len - matched.get(view.name, 0) * policy.block_size)
    return policy.prefill_s(view, tokens, queued=0) + policy.transfer.predict(prompt_len)
