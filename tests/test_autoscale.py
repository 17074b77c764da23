"""The autoscaler's decisions with the planner's real simulator (no mock of it): what a user would notice is which
pool grows, when, and what it never does (exceed max_workers, go below the minimum sizes, shrink on one whim)."""

from __future__ import annotations

import random

import pytest

from cluster.worker_metrics import MIN_REPORTED_STEPS, PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S, LinearCost
from pdcluster.autoscale import Hysteresis, Plan, StepCosts, calibrate, plan_split, workload_of
from pdcluster.bench import stats
from pdcluster.bench.workloads import build
from pdcluster.config import AutoscalerConfig, ClusterConfig
from pdcluster.yaml_source import ConfigError
from router.traffic import TrafficSnapshot, TrafficWindow

# NOTE: step costs of the order this machine's workers measure (SmolLM2-135M, one core: ~300 prompt tokens/s)
COSTS = StepCosts(prefill=[(0.02, 0.0033)], decode=[(0.03, 0.0033)], transfer=(0.005, 0.00001))


def config(**autoscaler: int) -> ClusterConfig:
    pools = {"prefill": {"replicas": autoscaler.get("min_prefill", 1)},
             "decode": {"replicas": autoscaler.get("min_decode", 1)}}
    return ClusterConfig.from_data({"router": {"slo_ttft_ms": 6000, "slo_itl_ms": 200}, **pools,
                                    "autoscaler": {"enabled": True, "max_workers": 4, **autoscaler}}, "test")


def traffic(rate: float, prompt: int, output: int, seed: int = 0, attainment: float | None = 1.0) -> TrafficSnapshot:
    rng = random.Random(seed)
    n = round(rate * 30)
    prompts = tuple(max(8, round(prompt * rng.lognormvariate(-0.05, 0.3))) for _ in range(n))
    return TrafficSnapshot(30.0, n, rate, prompts, (output,) * n, n, n, attainment)


# NOTE: documents at 0.8 req/s: ~480 prompt tokens/s, more than one prefill worker computes even with the decode
# worker taking prompts when the prefill queue grows (router/policy.py, the SLO rule: at 0.5 req/s 1P:1D may do)
CHAT, DOCUMENTS = traffic(0.5, 80, 50), traffic(0.8, 600, 12)


def test_chat_needs_one_of_each_and_documents_more_prefill_workers():
    cfg, profile = config(), calibrate(COSTS)
    chat, docs = plan_split(cfg, CHAT, profile), plan_split(cfg, DOCUMENTS, profile)
    assert (chat.prefill, chat.decode) == (1, 1) and chat.meets
    assert docs.prefill >= 2 and docs.prefill + docs.decode <= 4, docs.reason


def test_the_shift_from_chat_to_documents_adds_prefill_workers_after_two_evaluations():
    cfg, profile = config(up_evaluations=2), calibrate(COSTS)
    h = Hysteresis(cfg.autoscaler)
    assert h.judge((1, 1), plan_split(cfg, CHAT, profile), 1.0).action == "hold"
    first = h.judge((1, 1), plan_split(cfg, DOCUMENTS, profile), 0.4)
    assert first.action == "hold" and first.apply is None  # NOTE: one evaluation is not enough
    second = h.judge((1, 1), plan_split(cfg, traffic(0.8, 600, 12, seed=1), profile), 0.3)
    assert second.action == "up" and second.apply is not None and second.apply[0] >= 2, second.reason


def plan(p: int, d: int) -> Plan:
    return Plan(p, d, 0.95, True, f"{p}P:{d}D")


def test_shrinking_needs_more_evaluations_than_growing_and_met_slos():
    h = Hysteresis(AutoscalerConfig(up_evaluations=1, down_evaluations=3))
    assert h.judge((1, 1), plan(2, 1), 0.5).apply == (2, 1)  # grows on the first evaluation
    assert [h.judge((2, 1), plan(1, 1), 1.0).apply for _ in range(3)] == [None, None, (1, 1)]
    # the measured attainment misses the target: never shrink, whatever the model says
    assert [h.judge((2, 1), plan(1, 1), 0.5).apply for _ in range(5)] == [None] * 5
    # a plan that changes its mind resets the streak
    h.judge((2, 1), plan(1, 1), 1.0)
    h.judge((2, 1), plan(2, 1), 1.0)
    assert [h.judge((2, 1), plan(1, 1), 1.0).apply for _ in range(3)] == [None, None, (1, 1)]


def test_a_swap_within_max_workers_is_applied_whole():
    h = Hysteresis(AutoscalerConfig(max_workers=3, up_evaluations=1))
    assert h.judge((1, 2), plan(2, 1), 1.0).apply == (2, 1)  # 2P:2D would exceed max_workers 3
    h = Hysteresis(AutoscalerConfig(max_workers=4, up_evaluations=1))
    assert h.judge((1, 2), plan(2, 1), 1.0).apply == (2, 2)  # growth first; the decode worker goes when it may


@pytest.mark.parametrize("max_workers, min_prefill, min_decode", [(2, 1, 1), (3, 1, 2), (4, 2, 1)])
def test_overload_stays_within_max_workers_and_minimum_sizes(max_workers, min_prefill, min_decode):
    cfg = config(max_workers=max_workers, min_prefill=min_prefill, min_decode=min_decode)
    for snap in (traffic(3.0, 1500, 12), CHAT, traffic(2.0, 60, 300)):
        p = plan_split(cfg, snap, calibrate(COSTS))
        assert p.prefill >= min_prefill and p.decode >= min_decode and p.prefill + p.decode <= max_workers
    overloaded = plan_split(cfg, traffic(3.0, 1500, 12), calibrate(COSTS))
    assert not overloaded.meets and "no split" in overloaded.reason


def test_calibration_follows_the_measured_step_costs():
    slow = calibrate(StepCosts(prefill=[(0.02, 0.004)], decode=[(0.05, 0.004)]))
    fast = calibrate(StepCosts(prefill=[(0.02, 0.001)], decode=[(0.05, 0.001)]))
    assert slow.step.prefill_time(512) > 3 * fast.step.prefill_time(512)
    assert slow.step.c0_s == 0.05  # NOTE: the fixed cost from the decode workers' short steps
    cfg = config()
    assert plan_split(cfg, DOCUMENTS, slow).prefill > plan_split(cfg, DOCUMENTS, fast).prefill


def test_a_new_workers_slow_warm_up_step_does_not_make_its_prompts_look_slow():
    # NOTE: what starved a scaled-up prefill worker (CI, a loaded machine): the scaler's 8-token warm-up step took
    # 0.2 s, the fit put it on the slope (22 ms a token), and 800-token prompts were predicted at 18 s there
    # against 2 s on the old worker, so the router never sent it one
    cost = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)
    cost.observe(8, 0.2)
    assert cost.predict(8) == pytest.approx(0.2)
    assert cost.predict(800) < 0.2 * (PRIOR_STEP_BASE_S + 800 * PRIOR_STEP_TOKEN_S) / PRIOR_STEP_BASE_S
    old = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)
    for _ in range(8):
        old.observe(800, 2.0)
    assert cost.predict(800) < 3 * old.predict(800)
    # sizes that spread are fitted: base and slope both recovered
    fit = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)
    for n in (1, 64, 256, 1024) * 3:
        fit.observe(n, 0.01 + n * 0.002)
    assert fit.base_s == pytest.approx(0.01) and fit.per_token_s == pytest.approx(0.002)


def test_a_worker_reports_its_step_cost_only_once_it_measured_a_few_steps():
    # NOTE: a suite run: the scaler's warm-up step, 8 tokens on busy cores, took ~1.9 s; scaled onto the priors' split
    # it predicted 800-token prompts at ~32 s on the new worker (5 s on the old one), which then got none
    cost = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)
    cost.observe(8, 1.9)
    assert cost.heartbeat()["step_token_ns"] == 0 and cost.predict(800) > 10  # not sent: the router's priors
    for _ in range(MIN_REPORTED_STEPS - 2):
        cost.observe(800, 1.8)
    assert cost.heartbeat() == {"step_base_us": 0, "step_token_ns": 0}
    cost.observe(800, 1.8)
    assert cost.heartbeat()["step_token_ns"] > 0 and cost.predict(800) < 3 * 1.8


def test_the_simulated_workload_keeps_the_window_rate_and_lengths():
    w = workload_of(DOCUMENTS)
    lens = [len(s.turns[0].user_tokens) for s in w.sessions]
    assert w.rate == DOCUMENTS.rate and set(lens) <= set(DOCUMENTS.prompt_lens)
    assert abs(w.sessions[-1].arrival_s / len(w.sessions) - 1 / DOCUMENTS.rate) < 0.6


def test_the_traffic_window_counts_arrivals_and_slo_attainment():
    t = TrafficWindow(slo_ttft_ms=1000, slo_itl_ms=100)
    for i in range(10):
        t.arrived(100 + i, 20, now=100.0 + i)
    t.finished(0.5, 0.05, now=105.0)  # meets both
    t.finished(1.5, 0.05, now=106.0)  # late first token
    t.finished(0.5, 0.2, now=107.0)  # slow tokens
    t.failed(now=108.0)
    s = t.snapshot(5.0, now=110.0)  # arrivals at 105..109, endings at 105..108
    assert (s.arrivals, s.rate, s.prompt_lens[0]) == (5, 1.0, 105)
    assert (s.ended, s.met, s.attainment) == (4, 1, 0.25)
    late = t.snapshot(3.0, now=110.0)  # endings at 107, 108: a slow answer and a failure
    assert (late.ended, late.met, late.attainment) == (2, 0, 0.0)


@pytest.mark.parametrize("data, field", [
    ({"autoscaler": {"enabled": True, "max_workers": 1}}, "autoscaler.max_workers"),
    ({"autoscaler": {"enabled": True, "max_workers": 3}, "decode": {"replicas": 3}}, "autoscaler.max_workers"),
    ({"autoscaler": {"enabled": True, "up_evaluations": 4, "down_evaluations": 2}}, "autoscaler.down_evaluations"),
    ({"autoscaler": {"enabled": True, "min_prefill": 2}}, "prefill.replicas"),
    ({"autoscaler": {"enabled": True}, "mode": "colocated", "colocated": {"replicas": 1}}, "autoscaler.enabled"),
    ({"autoscaler": {"interval_s": 0}}, "autoscaler.interval_s"),
])
def test_bad_autoscaler_settings_name_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        ClusterConfig.from_data(data, "test")


def test_the_shifting_workload_is_chat_then_documents_and_reports_per_minute():
    w = build("chat_to_documents", 1.0, 40, seed=3)
    first, second = w.sessions[:20], w.sessions[20:]
    assert max(len(s.turns[0].user_tokens) for s in first) < 1100 <= min(len(s.turns[0].user_tokens) for s in second) \
        or sum(len(s.turns[0].user_tokens) for s in second) > 4 * sum(len(s.turns[0].user_tokens) for s in first)
    recs = [stats.RequestRecord(i, 0, sent, 10, 5, 5, ttft_ms=ttft, itl_ms=[10.0] * 4, e2e_ms=ttft + 40)
            for i, (sent, ttft) in enumerate([(1, 100), (59, 100), (61, 100), (70, 5000), (130, 100)])]
    per = stats.per_minute(recs, stats.Slo(1000, 50))
    assert per == [{"minute": 0, "requests": 2, "slo_attainment": 1.0},
                   {"minute": 1, "requests": 2, "slo_attainment": 0.5},
                   {"minute": 2, "requests": 1, "slo_attainment": 1.0}]


def test_a_prefill_backlog_asks_for_more_prefill_workers_before_the_rate_shows_it():
    cfg, profile = config(), calibrate(COSTS)
    assert plan_split(cfg, CHAT, profile).prefill == 1
    queued = plan_split(cfg, CHAT, profile, backlog_tokens=12_000)  # ~40 s of prompts for one worker
    # NOTE: more workers: prefill, or decode workers, which take prompts too while the prefill queue is long
    assert queued.prefill + queued.decode > 2 and "12000 queued" in queued.reason


def test_the_shifting_workload_is_seeded_and_plot_with_names_its_option(tmp_path):
    a, b = build("chat_to_documents", 0.6, 30, seed=2), build("chat_to_documents", 0.6, 30, seed=2)
    assert a == b
    from pdcluster.bench.serve import _saved_runs

    with pytest.raises(ValueError, match="--plot-with"):
        _saved_runs(str(tmp_path / "missing.json"))
