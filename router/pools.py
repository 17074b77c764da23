"""The workers as one router sees them: a handle per worker, the prefill and decode pools, and picking among them.

Both the Router (first choice, load refresh) and a RequestRun (another worker after a failure) pick here, with the
same Policy, so a failover never picks differently from a first choice on the same loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.messages import Role, WorkerInfo
from cluster.prefix_index import WorkerStatus
from router.metrics import RouterMetrics
from router.policy import Policy, Route, WorkerView


@dataclass
class WorkerHandle:
    """One worker as the router sees it: its Ray actor, what it said at start, and its load."""

    name: str
    role: Role
    actor: Any  # ray.actor.ActorHandle (plain objects with the same methods in unit tests)
    info: WorkerInfo
    view: WorkerView


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

    def __getitem__(self, name: str) -> WorkerHandle:
        return self.by_name[name]

    def route(self, prompt_len: int, max_tokens: int, matched: dict[str, int]) -> Route:
        """The first choice for a request; `matched` is how many leading prompt blocks each worker caches."""
        return self.policy.route(prompt_len, max_tokens, matched, [w.view for w in self.prefill],
                                 [w.view for w in self.decode])

    def pick_prefill(self, prompt_len: int, exclude: set[str]) -> WorkerHandle | None:
        """Another prefill worker for a failed attempt (load-based; None when every one was tried)."""
        views = [w.view for w in self.prefill if w.name not in exclude]
        return self.by_name[self.policy.pick_prefill(prompt_len, views).name] if views else None

    def pick_decode(self, prompt_len: int, max_tokens: int, exclude: set[str]) -> WorkerHandle | None:
        """Another decode worker after a failure (None when there is no other)."""
        views = [w.view for w in self.decode if w.name not in exclude]
        if not views:
            return None
        return self.by_name[self.policy.pick_decode(prompt_len, max_tokens, {}, views).name]

    def refresh(self, live: dict[str, WorkerStatus], metrics: RouterMetrics) -> None:
        """Take the heartbeat loads (and a restarted worker's new KV address) from the prefix index's statuses."""
        for name, w in self.by_name.items():
            status = live.get(name)
            if status is not None:
                w.view.load = status.load
                if status.address and status.address != w.info.kv_address:  # NOTE: a restarted worker
                    w.info = dataclasses.replace(w.info, kv_address=status.address, epoch=status.epoch)
            metrics.set_worker_load(name, w.role, w.view.load, status is not None)
