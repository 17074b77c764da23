"""The autoscaler while serving: every `interval_s`, read the router's traffic, plan, and resize the pools.

Life of one tick (`AutoscaleLoop.tick`):
1. skipped within `cooldown_s` of the last change, or while fewer than `min_requests` arrived in the window;
2. on the serving loop: the traffic window (router/traffic.py), the prompt tokens queued for prefill and the
   workers' measured step costs are read;
3. in a thread (the simulation is plain Python; the loop keeps serving): calibrate, plan, judge with hysteresis
   (pdcluster/autoscale.py);
4. a change goes through the scale path every operator uses (router/scaling.py `PoolScaler.scale`: new workers
   register and warm up before they take requests; surplus ones drain); each decision is logged with its reason and
   counted in `pdcluster_autoscaler_*`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from cluster.messages import Role
from pdcluster.autoscale import Decision, Hysteresis, StepCosts, calibrate, plan_split
from pdcluster.config import ClusterConfig
from pdcluster.plan.profile import Profile
from router.core import Router
from router.scaling import PoolScaler
from router.traffic import TrafficSnapshot

log = logging.getLogger(__name__)


class AutoscalerMetrics:
    """`pdcluster_autoscaler_*` on the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("pdcluster_autoscaler_decisions", "Autoscaler evaluations by outcome (up, down, "
                                 "hold, skipped, failed).", ["action"], registry=registry)
        self.target = Gauge("pdcluster_autoscaler_target_workers", "Workers the last plan asked for, per pool.",
                            ["pool"], registry=registry)
        self.attainment = Gauge("pdcluster_autoscaler_window_slo_attainment", "SLO attainment of the requests that "
                                "ended in the window (measured).", registry=registry)
        self.rate = Gauge("pdcluster_autoscaler_window_arrival_rate", "Requests per second arriving in the window.",
                          registry=registry)


class AutoscaleLoop:
    """Runs the autoscaler beside a serving router; `start()` on the serving loop, `close()` at shutdown."""

    def __init__(self, cfg: ClusterConfig, router: Router, scaler: PoolScaler) -> None:
        self.cfg, self.a = cfg, cfg.autoscaler
        self.router, self.scaler = router, scaler
        self.hysteresis = Hysteresis(self.a)
        self.base: Profile | None = Profile.load(self.a.profile) if self.a.profile else None
        self.metrics = AutoscalerMetrics(router.metrics.registry)
        self.last_change = time.monotonic()  # NOTE: the first window must see the cluster serving
        self.decisions: list[Decision] = []  # every evaluation's decision, oldest first (the tests read it)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.a.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed evaluation must not end the autoscaler
                self.metrics.decisions.labels("failed").inc()
                log.exception("autoscaler: evaluation failed")

    def step_costs(self) -> StepCosts:
        """The measured (fixed s, s per token) of each worker that has measured its steps, and the KV tail."""
        measured = [w for w in self.router.pools.by_name.values()
                    if w.view.load is not None and w.view.load.step_token_ns > 0]
        t = self.router.pools.policy.transfer
        return StepCosts([w.view.step_cost() for w in measured if w.role is Role.PREFILL],
                         [w.view.step_cost() for w in measured if w.role is not Role.PREFILL],
                         (t.base_s, t.per_token_s) if t.observed else None)

    async def tick(self) -> Decision | None:
        """One evaluation (and the change it decides, applied); None when skipped."""
        if time.monotonic() - self.last_change < self.a.cooldown_s or self.scaler.draining:
            self.metrics.decisions.labels("skipped").inc()
            return None
        snap = self.router.traffic.snapshot(self.a.window_s)
        self.metrics.rate.set(snap.rate)
        if snap.attainment is not None:
            self.metrics.attainment.set(snap.attainment)
        if snap.arrivals < self.a.min_requests:
            self.metrics.decisions.labels("skipped").inc()
            return None
        current, costs = self.scaler.counts(), self.step_costs()
        backlog = round(sum(w.view.queued_tokens() for w in self.router.pools.prefill))
        decision = await asyncio.to_thread(self.evaluate, current, snap, costs, backlog)
        self.decisions.append(decision)
        self.metrics.decisions.labels(decision.action).inc()
        if decision.plan is not None:
            self.metrics.target.labels("prefill").set(decision.plan.prefill)
            self.metrics.target.labels("decode").set(decision.plan.decode)
        measured = "n/a" if snap.attainment is None else f"{snap.attainment:.0%}"
        if decision.apply is None:
            log.info("autoscaler: hold %dP:%dD (measured attainment %s): %s", *current, measured, decision.reason)
            return decision
        log.warning("autoscaler: %s %dP:%dD -> %dP:%dD (measured attainment %s): %s", decision.action, *current,
                    *decision.apply, measured, decision.reason)
        try:
            await self.scaler.scale(*decision.apply)
        except Exception as e:  # noqa: BLE001 - e.g. Ray cannot place another worker: logged, tried again later
            self.metrics.decisions.labels("failed").inc()
            log.warning("autoscaler: scaling to %dP:%dD failed: %s", *decision.apply, e)
        self.last_change = time.monotonic()
        return decision

    def evaluate(self, current: tuple[int, int], snap: TrafficSnapshot, costs: StepCosts,
                 backlog_tokens: int = 0) -> Decision:
        """Plan for the window and judge it against the pools now (plain; runs in a thread)."""
        profile = calibrate(costs, self.base)
        plan = plan_split(self.cfg, snap, profile, backlog_tokens)
        return self.hysteresis.judge(current, plan, snap.attainment)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
