"""What the failover tests steer and watch in a running cluster: the router's placement (its SLO target and its own
counts of what it sent where) and the workers' state (restarts, loads, heartbeats), read in the test's process.

tests/test_failover.py kills workers with requests in flight; these say where a request will go, which worker is
busy with it, and when the cluster is back at rest.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future


def wait_restarted(c, name: str, old_epoch: int, timeout: float = 120.0) -> int:
    index = c.index()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = {w.name: w for w in index.workers()}
        if name in live and live[name].epoch > old_epoch:
            return live[name].epoch
        time.sleep(0.5)
    raise AssertionError(f"{name} did not come back with a new epoch")


def router_loads(server, within_s: float = 5.0) -> dict[str, tuple[int, int]]:
    """The router's own load per worker (requests in flight, prompt tokens pending) once it is back at zero, or
    the last seen at the deadline (the router's side of a stream may finish just after the client's)."""
    router = server.router
    deadline = time.monotonic() + within_s
    while True:
        loads = {w.name: (w.view.inflight, w.view.pending_tokens) for w in router.pools.by_name.values()}
        if (router.inflight == 0 and not any(any(v) for v in loads.values())) or time.monotonic() > deadline:
            return {"router": (router.inflight, 0), **loads}
        time.sleep(0.05)

@contextlib.contextmanager
def slo_itl_target(server, seconds: float | None):
    """The router's ITL target for the SLO rule (router/policy.py) set to `seconds` (None: the rule is off), then
    restored."""
    policy = server.router.pools.policy
    target, policy.slo_itl_s = policy.slo_itl_s, seconds
    try:
        yield
    finally:
        policy.slo_itl_s = target


def slo_rule_off(server):
    """Every fresh prompt goes to the prefill pool: the router's SLO rule, which may compute a prompt on an idle decode
    worker instead, is off. NOTE: in the suite, the loop this replaced waited out its 60 s without seeing prefill-0
    busy (70 s against 9 s alone), then killed it anyway: the prompts had gone elsewhere."""
    return slo_itl_target(server, None)


def busy_prefill_worker(c, server, requests: Future, within_s: float) -> str:
    """The name of the first prefill worker seen computing prompts: the router has sent it prompts whose first token
    has not come back. Fails after `within_s`, or once `requests` (the streams) ended, with where the prompts went:
    what the streams ended with, the router's view, the index's.

    NOTE: the router's own count, read in this process every few ms. What this read before, each prefill worker's load
    through a Ray call per poll, saw no prompt in 60 s once, in a suite run on two busy cores (session 24, cause not
    found: a prefill pool busy for a moment between two slow polls is one candidate)."""
    names = sorted(n for n in c.actors if n.startswith("prefill-"))
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not requests.done():
        for name in names:
            worker = server.router.pools.by_name.get(name)
            if worker is not None and worker.view.pending_tokens > 0:
                return name
        time.sleep(0.002)
    seen = {w.name: (w.view.inflight, w.view.pending_tokens) for w in server.router.pools.by_name.values()}
    live = {w.name: (w.role, w.epoch) for w in c.index().workers()}
    if not requests.done():
        ended = "still running"
    elif requests.exception() is not None:
        ended = f"failed: {requests.exception()!r}"
    else:
        ended = "ended on " + str([(last.timeline.prefill_worker, last.timeline.decode_worker)
                                   for *_, last in requests.result()])
    raise AssertionError(f"no prefill worker of {names} was seen computing a prompt within {within_s} s; the streams: "
                         f"{ended}; the router's in-flight requests and prompt tokens per worker: {seen}; live in the "
                         f"index: {live}")


@contextlib.contextmanager
def prefill_pool_backlogged(server, tokens: int = 200_000):
    """The router sees `tokens` queued on every prefill worker, and an ITL target no decode step misses: the SLO rule
    places every fresh prompt on the decode pool (router/policy.py).

    NOTE: the backlog is the router's own count of what it sent there (`WorkerView.pending_tokens`), so the prefill
    cores stay free for the decode workers' prompts on a 2-core machine; the target is the router's, while the
    engines keep their own 100 ms budget (an idle batch takes whole steps).
    """
    views = [w.view for w in server.router.prefill]
    for v in views:
        v.pending_tokens += tokens
    try:
        with slo_itl_target(server, 10.0):
            yield
    finally:
        for v in views:
            v.pending_tokens -= tokens


@contextlib.contextmanager
def decode_pool_saturated(server, requests: int = 100_000):
    """The router counts `requests` of its own on every decode worker: their steps are predicted far past the ITL
    target, so a request stays whole on the prefill worker (router/policy.py, "stay").

    NOTE: that many: a decode worker that has only decoded since it started measured a small cost per token (its
    steps are mostly the fixed cost), and a thousand would still fit its predicted step within the target.
    """
    views = [w.view for w in server.router.decode]
    for v in views:
        v.inflight += requests
    try:
        yield
    finally:
        for v in views:
            v.inflight -= requests


def prefill_heartbeats_idle(server, within_s: float = 30.0) -> None:
    """Wait until every prefill worker's last heartbeat shows nothing running, queued or reserved.

    NOTE: a heartbeat is up to half a second old: one sent while the previous request still decoded there says
    `running` 1, and the router then predicts this prompt's chunks beside that decode batch (slower than the
    prefill path) and rightly sends it through the prefill pool instead of keeping it ("stay")
    """
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        loads = [w.view.load for w in server.router.prefill]
        if all(ld is not None and not (ld.running or ld.waiting or ld.reserved or ld.pending_prefill_tokens)
               for ld in loads):
            return
        time.sleep(0.05)
    raise AssertionError(f"prefill workers still busy after {within_s} s: {loads}")

def decode_prompt_tokens(server) -> int:
    """Prompt tokens the decode pool's engines took, as their heartbeats say."""
    return sum(w.view.load.prompt_tokens for w in server.router.decode if w.view.load is not None)

def decode_failovers(server) -> float:
    return server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) or 0.0
