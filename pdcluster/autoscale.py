"""The autoscaler's decision: the cheapest prefill:decode split the planner's simulator finds for the live traffic.

One evaluation (`Autoscaler.evaluate`, plain and synchronous; pdcluster/autoscale_loop.py runs it while serving):
1. the traffic of the window (router/traffic.py: arrival rate, the prompt and output lengths asked for, measured
   SLO attainment) becomes a workload: Poisson arrivals at the measured rate, lengths drawn from the window's,
   behind the prompts queued for prefill now (the queue depth);
2. a profile is calibrated from the workers' measured step costs (`calibrate`): the simulator's steps cost what
   this cluster's steps cost now;
3. the planner (pdcluster/plan/search.py) finds the cheapest split within `max_workers` that meets the router's SLOs
   (TTFT ≤ slo_ttft_ms, TPOT ≤ slo_itl_ms, for `attainment` of the requests); none: the best split of max_workers;
   the pools' minimum sizes apply;
4. hysteresis (`Hysteresis.judge`): a plan with more workers in a pool must come `up_evaluations` times in a row, one
   with fewer `down_evaluations` times in a row and only while the measured attainment meets the target; after a
   change, `cooldown_s` without evaluations (the loop's job).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cluster.worker_metrics import PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S
from pdcluster.bench.workloads import Session, Turn, Workload
from pdcluster.config import AutoscalerConfig, ClusterConfig
from pdcluster.plan.profile import Profile, StepModel, TransferModel
from pdcluster.plan.search import Planner, Slo, Trial
from pdcluster.plan.simulator import ClusterShape, Overheads
from router.traffic import TrafficSnapshot

HORIZON_S = 60.0  # simulated arrivals span at least this long (the window may be shorter)
MAX_SIM_REQUESTS = 160  # ... and at most this many requests (one evaluation must stay well under a second or two)
VOCAB = (256, 49152)
EXHAUSTIVE_MAX = 8  # max_workers up to which every split is tried when the search finds none

Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class StepCosts:
    """What the workers measured: (fixed s, s per token) of an engine step, per role; empty lists: not yet."""

    prefill: list[tuple[float, float]] = field(default_factory=list)
    decode: list[tuple[float, float]] = field(default_factory=list)
    transfer: tuple[float, float] | None = None  # the router's fit of the KV tail: (fixed s, s per prompt token)


def calibrate(costs: StepCosts, base: Profile | None = None) -> Profile:
    """A profile whose steps cost what this cluster's workers measure.

    NOTE: prefill workers run long steps (the per-token cost shows), decode workers short ones (the fixed cost
    shows), so each gives the term it measures best. With a `base` profile (from `plan profile`), its step model is
    kept and scaled so that a 512-token prefill costs what the workers measure; without one, the measured linear
    model is the step model.
    """
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    per_token = mean([c[1] for c in costs.prefill]) if costs.prefill else (
        mean([c[1] for c in costs.decode]) if costs.decode else PRIOR_STEP_TOKEN_S)
    fixed = mean([c[0] for c in costs.decode]) if costs.decode else (
        mean([c[0] for c in costs.prefill]) if costs.prefill else PRIOR_STEP_BASE_S)
    xfer_fixed, xfer_tok = costs.transfer or (0.002, 0.0)
    # NOTE: the KV transfer model is in bytes; the router measures it per prompt token, so one "byte" per token
    transfer = TransferModel(bandwidth_gb_s=1.0 / max(xfer_tok, 1e-12) / 1e9, latency_s=xfer_fixed, layerwise=False)
    if base is not None:
        measured = fixed + 512 * per_token
        scale = measured / base.step.prefill_time(512)
        s = base.step
        step = s.model_copy(update={k: getattr(s, k) * scale
                                    for k in ("c0_s", "c_tok_s", "c_seq_s", "c_dec_key_s", "c_pre_pair_s")})
        return base.model_copy(update={"step": step, "transfer": transfer, "kv_bytes_per_token": 1,
                                       "gpus_per_worker": 1})
    return Profile(hardware="this cluster (measured step costs)", model="served", estimated=False,
                   step=StepModel(c0_s=fixed, c_tok_s=per_token), transfer=transfer, kv_bytes_per_token=1,
                   gpus_per_worker=1, source="autoscaler")


def workload_of(snap: TrafficSnapshot, backlog_tokens: int = 0, seed: int = 0) -> Workload:
    """Poisson arrivals at the window's rate for HORIZON_S (at most MAX_SIM_REQUESTS), lengths drawn from it,
    behind the prompt tokens queued for prefill now (`backlog_tokens`, as prompts of the window's mean length).

    NOTE: the backlog is where the cluster starts from: a burst that one prefill worker has not worked off yet
    shows there before the window's mean rate shows it.
    """
    rng = random.Random(seed)
    n = max(1, min(MAX_SIM_REQUESTS, round(snap.rate * max(HORIZON_S, snap.window_s))))
    pairs = list(zip(snap.prompt_lens, snap.output_lens))
    mean_out = max(1, round(snap.output_mean))
    queued = [(max(1, round(snap.prompt_mean)), mean_out)] * min(MAX_SIM_REQUESTS,
                                                                  round(backlog_tokens / max(1.0, snap.prompt_mean)))
    sessions, t = [], 0.0
    for sid in range(len(queued) + n):
        if sid < len(queued):
            prompt, out = queued[sid]
        else:
            t += rng.expovariate(snap.rate)
            prompt, out = rng.choice(pairs)
        tokens = tuple(rng.randrange(*VOCAB) for _ in range(max(1, prompt)))  # NOTE: unique: no prefix hits
        sessions.append(Session(sid, t, (Turn(tokens, max(1, out)),)))
    return Workload("live", snap.rate, tuple(sessions), {"seed": seed})


@dataclass(frozen=True)
class Plan:
    """What the planner chose for the window, and why."""

    prefill: int
    decode: int
    predicted_attainment: float
    meets: bool  # False: no split within max_workers meets the SLOs; this is the best one
    reason: str


def plan_split(cfg: ClusterConfig, snap: TrafficSnapshot, profile: Profile, backlog_tokens: int = 0,
               log: Callable[[str], None] = lambda m: None) -> Plan:
    """The cheapest split within autoscaler.max_workers meeting the router's SLOs on the window's traffic."""
    a = cfg.autoscaler
    disagg = cfg.model_copy(deep=True)
    disagg.prefill.replicas = disagg.decode.replicas = 1
    shape = ClusterShape.from_config(disagg, profile)
    slo = Slo(ttft_ms=cfg.router.slo_ttft_ms, itl_ms=cfg.router.slo_itl_ms or 1e9, attainment=a.attainment)
    planner = Planner(shape, None, profile, Overheads(), workload_of(snap, backlog_tokens), slo, a.max_workers, log)
    traffic = (f"{snap.rate:.2f} req/s, prompt mean {snap.prompt_mean:.0f}, output mean {snap.output_mean:.0f} "
               f"tokens, {backlog_tokens} queued for prefill")
    best = planner.cheapest()
    if best is not None and best.prefill >= a.min_prefill and best.decode >= a.min_decode:
        return Plan(best.prefill, best.decode, best.attainment, True,
                    f"{traffic}: {best.prefill}P:{best.decode}D is the cheapest split predicted to meet the SLOs "
                    f"({best.attainment:.0%} of requests)")
    if best is not None:
        p, d = max(best.prefill, a.min_prefill), max(best.decode, a.min_decode)
        if p + d <= a.max_workers:
            t = planner.run(p, d)
            return Plan(p, d, t.attainment, True, f"{traffic}: {best.prefill}P:{best.decode}D meets the SLOs; "
                                                  f"{p}P:{d}D with the pools' minimum sizes")
    # NOTE: the search's bounds assume room for a generous pool beside the other; with a few workers it can miss a
    # split that fits: try every split within max_workers (up to EXHAUSTIVE_MAX), else the splits of max_workers
    n = a.max_workers
    totals = range(a.min_prefill + a.min_decode, n + 1) if n <= EXHAUSTIVE_MAX else (n,)
    trials = [planner.run(p, k - p) for k in totals for p in range(a.min_prefill, k - a.min_decode + 1)]
    feasible = [t for t in trials if planner.ok(t)]
    if feasible:
        t = min(feasible, key=lambda t: (t.prefill + t.decode, -t.attainment))
        return Plan(t.prefill, t.decode, t.attainment, True, f"{traffic}: {t.prefill}P:{t.decode}D is the cheapest "
                    f"split predicted to meet the SLOs ({t.attainment:.0%} of requests)")
    top = max(trials, key=lambda t: (t.attainment, t.ttft_ok + t.tpot_ok, -_lateness(t, slo)))
    return Plan(top.prefill, top.decode, top.attainment, False,
                f"{traffic}: no split of at most {n} workers meets the SLOs; {top.prefill}P:{top.decode}D does best "
                f"({top.attainment:.0%} predicted)")


def _lateness(t: Trial, slo: Slo) -> float:
    """How far past the SLOs a split's p90 TTFT and TPOT are: splits that all miss are ranked by it."""
    s = t.summary
    return s["ttft_ms"]["p90"] / slo.ttft_ms + s["tpot_ms"]["p90"] / slo.itl_ms


@dataclass
class Decision:
    """One evaluation's outcome: `apply` is the pools' new sizes, or None to leave them."""

    action: Action
    current: tuple[int, int]
    plan: Plan | None
    apply: tuple[int, int] | None
    reason: str


class Hysteresis:
    """Consecutive evaluations a change must win before it is applied; shrinking needs more than growing."""

    def __init__(self, cfg: AutoscalerConfig) -> None:
        self.cfg = cfg
        self.up_streak = 0  # evaluations in a row whose plan grows a pool
        self.down_streak = 0  # ... whose plan shrinks one

    def judge(self, current: tuple[int, int], plan: Plan, measured: float | None) -> Decision:
        target = (plan.prefill, plan.decode)
        grow = any(t > c for t, c in zip(target, current))
        shrink = any(t < c for t, c in zip(target, current))
        # NOTE: never shrink while the cluster misses its SLOs now, whatever the model predicts
        shrink_ok = shrink and (measured is None or measured >= self.cfg.attainment)
        self.up_streak = self.up_streak + 1 if grow else 0
        self.down_streak = self.down_streak + 1 if shrink_ok else 0
        up_n, down_n = self.cfg.up_evaluations, self.cfg.down_evaluations
        if grow and self.up_streak >= up_n:
            new = (max(target[0], current[0]), max(target[1], current[1]))
            # NOTE: a swap (one pool up, the other down) within max_workers shrinks at once: growth alone would not fit
            if sum(new) > self.cfg.max_workers or (shrink_ok and self.down_streak >= down_n):
                new = target
            self.up_streak = self.down_streak = 0
            return Decision("up", current, plan, new, f"{plan.reason}; asked {up_n} evaluations in a row")
        if shrink_ok and not grow and self.down_streak >= down_n:
            self.up_streak = self.down_streak = 0
            return Decision("down", current, plan, target, f"{plan.reason}; asked {down_n} evaluations in a row")
        if grow:
            why = f"more workers asked {self.up_streak} of {up_n} evaluations in a row"
        elif shrink and not shrink_ok:
            why = f"fewer workers asked, but the measured attainment {measured:.0%} misses the target"
        elif shrink:
            why = f"fewer workers asked {self.down_streak} of {down_n} evaluations in a row"
        else:
            why = "the pools match the plan"
        return Decision("hold", current, plan, None, f"{plan.reason}; {why}")
