"""The workers as one router sees them: a handle per worker, the prefill and decode pools, and picking among them.

Both the Router (first choice, load refresh) and a RequestRun (another worker after a failure) pick here, with the
same Policy, so a failover never picks differently from a first choice on the same loads.

Only workers that are up are picked: live (a fresh heartbeat and an answered ping, `set_live`) and not shut out by
their circuit breaker (router/breaker.py) since a request failed there (`mark_failed`). When no decode worker is up,
the pick falls back to every one (the request then fails or probes, rather than being refused here); when no
prefill worker is up, the decode worker prefills.
A request with a LoRA adapter is only given workers that have it resident: `missing` names, per worker, the adapters
it lacks (router/lora.py: a fresh process until the run-time adapters are loaded onto it again, or one that failed
to load them). With no decode worker holding it the pick falls back as above (the worker then refuses the request
naming the adapter); with no prefill worker holding it the decode worker prefills.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.messages import Role, WorkerInfo
from cluster.prefix_index import WorkerStatus
from router.breaker import Breaker
from router.delta_channel import DeltaChannel
from router.metrics import RouterMetrics
from router.policy import Policy, Route, WorkerView

log = logging.getLogger(__name__)

@dataclass
class WorkerHandle:
    """One worker as the router sees it: its Ray actor, what it said at start, and its load."""

    name: str
    role: Role
    actor: Any  # ray.actor.ActorHandle (plain objects with the same methods in unit tests)
    info: WorkerInfo
    view: WorkerView
    channel: DeltaChannel = dataclasses.field(init=False)  # the worker's delta channel (router/delta_channel.py)

    def __post_init__(self) -> None:
        self.channel = DeltaChannel(self.name)


class WorkerPools:
    """Worker handles by name, split into the prefill and the decode pool; picks workers through the Policy."""

    def __init__(self, workers: Sequence[WorkerHandle], policy: Policy) -> None:
        if not workers:
            raise ValueError("a router needs workers")
        self.by_name = {w.name: w for w in workers}
        self.prefill = [w for w in workers if w.role is Role.PREFILL]
        self.decode = [w for w in workers if w.role.decodes]
        self.info = workers[0].info  # NOTE: every worker serves the same model, so any one describes it
        self.policy = policy
        self.breakers = {w.name: Breaker() for w in workers}
        self.live: set[str] | None = None  # workers with a fresh heartbeat that answer pings; None: not known yet
        self.metrics: RouterMetrics | None = None  # the router's, once it set them
        self.removed: dict[str, WorkerHandle] = {}  # retired workers: runs that still name one find its handle
        self.on_new_process: list[Callable[[WorkerHandle], None]] = []  # a worker joined or restarted (a fresh one)
        self.missing: dict[str, set[str]] = {}  # worker → LoRA adapters it lacks (router/lora.py)

    def __getitem__(self, name: str) -> WorkerHandle:
        return self.by_name[name] if name in self.by_name else self.removed[name]

    # ---- membership while serving (router/scaling.py) ---------------------------------------------------------
    def add(self, worker: WorkerHandle) -> None:
        """A worker that joined while serving; it takes requests once it is live (its heartbeat and a ping)."""
        self.by_name[worker.name] = worker
        self.breakers[worker.name] = Breaker()
        self.removed.pop(worker.name, None)
        self.hold(worker.name, False)
        for listener in self.on_new_process:
            listener(worker)

    def hold(self, name: str, held: bool = True) -> None:
        """Stop (or resume) picking `name` for new requests; its running requests go on."""
        w = self.by_name[name]
        pool = self.prefill if w.role is Role.PREFILL else self.decode
        if held and w in pool:
            pool.remove(w)
        elif not held and w not in pool:
            pool.append(w)

    def remove(self, name: str) -> None:
        """Forget a drained or dead worker (its handle stays findable by name for runs that touched it)."""
        self.hold(name)
        self.removed[name] = self.by_name.pop(name)

    # ---- which workers are up ------------------------------------------------------------------------------
    def mark_failed(self, worker_id: str) -> None:
        """A request failed on this worker (it died, timed out, or its KV endpoint refused): avoid it from now on,
        until its breaker lets a probe through (router/breaker.py)."""
        breaker = self.breakers.get(worker_id)
        if breaker is None:
            return
        breaker.failed()
        if self.metrics is not None:
            self.metrics.worker_failed(worker_id)
        log.warning("worker %s failed a request (%d in a row): avoided for %.0f s", worker_id, breaker.failures,
                    breaker.cooldown_s())

    def mark_ok(self, worker_id: str) -> None:
        """A request succeeded on this worker: its breaker closes."""
        breaker = self.breakers.get(worker_id)
        if breaker is not None and breaker.failures:
            log.info("worker %s served a request again: back in rotation", worker_id)
            breaker.succeeded()

    def set_live(self, live: set[str] | None) -> None:
        """The workers that have a fresh heartbeat and answer pings (None: not known, every worker counts as live)."""
        self.live = live

    def is_up(self, name: str, now: float | None = None) -> bool:
        """Live and not shut out by its breaker."""
        return (self.live is None or name in self.live) and self.breakers[name].available(now)

    def _up(self, workers: list[WorkerHandle], exclude: Collection[str] = (), lora: str | None = None
            ) -> list[WorkerHandle]:
        now = time.monotonic()
        return [w for w in self.holding(workers, lora) if w.name not in exclude and self.is_up(w.name, now)]

    def holding(self, workers: list[WorkerHandle], lora: str | None) -> list[WorkerHandle]:
        """The workers that have adapter `lora` resident (all of them for the base model)."""
        if lora is None or not self.missing:
            return workers
        return [w for w in workers if lora not in self.missing.get(w.name, ())]

    # ---- picking -------------------------------------------------------------------------------------------
    def route(self, prompt_len: int, max_tokens: int, matched: dict[str, int], lora: str | None = None) -> Route:
        """The first choice for a request (with adapter `lora`, None: the base model); `matched` is how many leading
        prompt blocks each worker caches."""
        # NOTE: with no decode worker up the request still goes to one (it fails with UNAVAILABLE, or probes one
        # that came back), instead of being refused before any worker was tried
        decode = self._up(self.decode, lora=lora) or self._up(self.decode) or self.decode
        route = self.policy.route(prompt_len, max_tokens, matched, [w.view for w in self._up(self.prefill, lora=lora)],
                                  [w.view for w in decode])
        now = time.monotonic()
        for name in (route.prefill, route.decode):
            if name is not None:
                self.breakers[name].picked(now)
        return route

    def pick_prefill(self, prompt_len: int, exclude: set[str], lora: str | None = None) -> WorkerHandle | None:
        """Another prefill worker for a failed attempt (load-based; None when every one up was tried)."""
        views = [w.view for w in self._up(self.prefill, exclude, lora)]
        if not views:
            return None
        pick = self.by_name[self.policy.pick_prefill(prompt_len, views).name]
        self.breakers[pick.name].picked()
        return pick

    def pick_decode(self, prompt_len: int, max_tokens: int, exclude: set[str], lora: str | None = None
                    ) -> WorkerHandle | None:
        """Another decode worker after a failure, one that is up if any (None when there is no other)."""
        views = [w.view for w in self._up(self.decode, exclude, lora) or self._up(self.decode, exclude)
                 or [w for w in self.decode if w.name not in exclude]]
        if not views:
            return None
        pick = self.by_name[self.policy.pick_decode(prompt_len, max_tokens, {}, views).name]
        self.breakers[pick.name].picked()
        return pick

    def refresh(self, live: dict[str, WorkerStatus], metrics: RouterMetrics) -> None:
        """Take the heartbeat loads (and a restarted worker's new KV address) from the prefix index's statuses."""
        for name, w in self.by_name.items():
            status = live.get(name)
            if status is not None:
                w.view.load = status.load
                restarted = status.epoch != w.info.epoch or (status.address and status.address != w.info.kv_address)
                if restarted:  # NOTE: a new process: the old one's failures say nothing about it
                    w.info = dataclasses.replace(w.info, kv_address=status.address or w.info.kv_address,
                                                 epoch=status.epoch)
                    self.breakers[name].succeeded()
                    for listener in self.on_new_process:
                        listener(w)
            metrics.set_worker_load(name, w.role, w.view.load, status is not None)
