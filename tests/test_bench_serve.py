"""The pieces of `pdcluster bench serve` that need no cluster: workloads, latency statistics, goodput."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pdcluster.bench import stats
from pdcluster.bench.stats import RequestRecord
from pdcluster.bench.workloads import SHARED_PROMPT_LEN, SHARED_PROMPT_TURNS, WORKLOADS, build


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_seed_fixes_lengths_at_every_rate_and_salt_while_arrivals_scale(name):
    a = build(name, 1.0, 40, seed=3)
    b = build(name, 4.0, 40, seed=3, salt=1)
    shape = [[(len(t.user_tokens), t.max_tokens) for t in s.turns] for s in a.sessions]
    assert shape == [[(len(t.user_tokens), t.max_tokens) for t in s.turns] for s in b.sessions]
    assert [s.think_s for s in a.sessions] == [s.think_s for s in b.sessions]
    for sa, sb in zip(a.sessions, b.sessions):
        assert sb.arrival_s == pytest.approx(sa.arrival_s / 4)
    assert a.sessions[0].turns[0].user_tokens != b.sessions[0].turns[0].user_tokens  # a new salt, new tokens
    assert build(name, 1.0, 40, seed=3) == a


def test_sharegpt_lengths_follow_the_published_means():
    w = build("sharegpt", 1.0, 3000, seed=0)
    ins = [len(s.turns[0].user_tokens) for s in w.sessions]
    outs = [s.turns[0].max_tokens for s in w.sessions]
    # ShareGPT in the vLLM paper: 161 prompt / 338 output tokens on average (clamping trims the tail a little)
    assert 130 < statistics.mean(ins) < 175
    assert 280 < statistics.mean(outs) < 350
    assert statistics.median(ins) < statistics.mean(ins)  # heavy tailed


def test_shared_prompt_sessions_share_one_system_prompt_and_resend_the_conversation():
    w = build("shared_prompt", 1.0, 16, seed=1)
    assert w.num_requests == 16 and len(w.sessions) == 16 // SHARED_PROMPT_TURNS
    first = [s.turns[0].user_tokens[:SHARED_PROMPT_LEN] for s in w.sessions]
    assert all(f == first[0] for f in first)
    assert w.sessions[0].turns[0].user_tokens[SHARED_PROMPT_LEN:] != w.sessions[1].turns[0].user_tokens[
        SHARED_PROMPT_LEN:]
    s = w.sessions[0]
    answers = [[-1] * t.max_tokens for t in s.turns]
    for i in range(len(s.turns)):
        prompt = s.prompt(i, answers)
        assert len(prompt) == s.prompt_len(i)
        if i:
            assert prompt[: s.prompt_len(i - 1)] == s.prompt(i - 1, answers)  # turn i extends turn i-1
    assert len(s.think_s) == SHARED_PROMPT_TURNS - 1


def test_think_scale_stretches_the_pauses_between_turns_and_nothing_else():
    w = build("shared_prompt", 2.0, 16, seed=1)
    short = build("shared_prompt", 2.0, 16, seed=1, think_scale=0.1)
    assert [s.think_s for s in short.sessions] == [tuple(t * 0.1 for t in s.think_s) for s in w.sessions]
    assert all(s.think_s and min(s.think_s) > 0 for s in short.sessions)
    assert [(s.arrival_s, s.turns) for s in short.sessions] == [(s.arrival_s, s.turns) for s in w.sessions]
    assert short.params["think_scale"] == 0.1
    assert all(not any(s.think_s) for s in build("shared_prompt", 2.0, 16, seed=1, think_scale=0).sessions)


def test_mixed_has_a_fifth_long_prompts():
    w = build("mixed", 1.0, 1000, seed=0)
    long = [s for s in w.sessions if len(s.turns[0].user_tokens) >= 1000]
    assert 0.15 < len(long) / 1000 < 0.25


def test_bad_workload_arguments_name_the_field():
    with pytest.raises(ValueError, match="workload"):
        build("nope", 1.0, 10)
    with pytest.raises(ValueError, match="rate"):
        build("mixed", 0.0, 10)
    with pytest.raises(ValueError, match="think_scale"):
        build("shared_prompt", 1.0, 10, think_scale=-1)


def _rec(ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    r = RequestRecord(0, 0, 0.0, 10, len(gaps) + 1, output_len=len(gaps) + 1, ttft_ms=ttft, itl_ms=gaps,
                      e2e_ms=ttft + sum(gaps), error=error)
    return r


def test_summary_percentiles_tpot_and_slo_attainment():
    records = [_rec(100, [10, 10, 10]), _rec(300, [50, 50]), _rec(1000, [10]), _rec(0, [], error="UNAVAILABLE: x")]
    s = stats.summarize(records, elapsed_s=2.0, slo=stats.Slo(ttft_ms=500, itl_ms=20))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["ttft_ms"]["p50"] == 300
    assert s["itl_ms"]["p50"] == 10 and s["itl_ms"]["mean"] == pytest.approx(140 / 6, abs=0.01)
    assert s["tpot_ms"]["p50"] == 10  # request 2 has TPOT 50
    # only the first request meets both SLOs (the second misses ITL, the third TTFT, the fourth failed)
    assert s["slo_attainment"] == 0.25
    assert s["output_tok_per_s"] == pytest.approx((4 + 3 + 2) / 2.0)


def test_goodput_is_the_highest_rate_meeting_90_percent():
    g = stats.goodput([(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.5)])
    assert g["goodput_req_per_s"] == 2.0
    assert g["goodput_estimate_req_per_s"] == pytest.approx(2.5)  # 0.95 → 0.85 crosses 0.9 half way
    assert stats.goodput([(1.0, 0.5)]) == {"goodput_req_per_s": None, "goodput_estimate_req_per_s": None}
    # a dip below and back above does not count: goodput is the rate before the first miss
    assert stats.goodput([(1.0, 0.95), (2.0, 0.8), (3.0, 0.92)])["goodput_req_per_s"] == 1.0


@pytest.mark.slow
def test_a_bench_cluster_that_cannot_start_fails_with_its_own_message():
    from pdcluster.bench.cluster_proc import load, serving

    config = load("deploy/bench-disagg.yaml", routing="round_robin")
    assert config.router.routing == "round_robin" and config.router.port == 0 and not config.http.enabled
    config.ray.num_cpus = 1  # the two pools reserve 2 CPUs: `serve` refuses to start, naming them
    with pytest.raises(RuntimeError, match="did not start(.|\n)*the pools need 2 CPU"):
        with serving(config, "too small", start_timeout_s=120):
            pass


@pytest.mark.slow
def test_bench_compare_runs_both_routings_on_fresh_clusters_and_reports_the_ratio(tmp_path):
    import json

    from pdcluster.cli import main

    out = tmp_path / "compare.json"
    # NOTE: the shipped routing cluster with the tiny model and one prefill worker (the routings differ in where the
    # two decode workers' prefix caches send each turn): what is tested is the bench, not SmolLM2 or the pool sizes
    config = tmp_path / "bench-routing-tiny.yaml"
    shipped = Path("deploy/bench-routing.yaml").read_text()
    assert "prefill:\n  replicas: 2\n" in shipped
    config.write_text(shipped.replace("model: smollm2", "model: tiny", 1)
                      .replace("prefill:\n  replicas: 2\n", "prefill:\n  replicas: 1\n", 1))
    assert main(["bench", "compare", "--only", "routing", "--routing-config", str(config), "--routing-rates", "4",
                 "--routing-num-requests", "4", "--input-scale", "0.1", "--output-scale", "0.1", "--think-scale", "0.1",
                 "--warmup-requests", "1", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    by = {r["routing"]: r["summary"] for r in figures["runs"]}
    assert set(by) == {"prefix_aware", "round_robin"} and all(s["completed"] == 4 for s in by.values())
    # follow-up turns go back to the decode worker holding the conversation, which prefills the rest itself
    assert by["prefix_aware"]["prefill_skipped"] >= 1 and by["round_robin"]["prefill_skipped"] == 0
    (row,) = figures["prefix_aware_vs_round_robin"]
    assert row["ttft_p50_ratio"] == pytest.approx(row["ttft_p50_ms"][0] / row["ttft_p50_ms"][1], abs=1e-3)
    assert "disaggregated_vs_colocated" not in figures
    assert [p.rsplit("_", 2)[-2:] for p in figures["plots"]] == [["routing", "cdf.png"], ["routing", "slo.png"]]
    md = (tmp_path / "compare.md").read_text()
    assert md.count("| prefix-aware | 4 |") == 1 and md.count("| round-robin | 4 |") == 1
    assert "| prefix-aware (A) vs round-robin (B) | shared_prompt | 4 | TTFT p50 (ms) |" in md


@pytest.mark.parametrize("argv,words", [
    (["bench", "serve", "--rates", "0,1"], "--rates: every rate must be > 0"),
    (["bench", "serve", "--rates", "fast"], "--rates: expected numbers"),
    (["bench", "compare", "--routing-rates", "-1"], "--routing-rates: every rate must be > 0"),
    (["bench", "compare", "--think-scale", "-0.5"], "--think-scale: must be >= 0, got -0.5"),
    (["bench", "serve", "--config", "deploy/nope.yaml"], "no such file"),
])
def test_bad_bench_options_fail_before_any_cluster_starts(argv, words, capsys):
    from pdcluster.cli import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err
