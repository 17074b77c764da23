"""`pdcluster bench path`'s own accounting: the router's CPU per request is read from every thread's schedstat, in
nanoseconds, and the table prints it beside the first token's timeline."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from pdcluster.bench import path
from pdcluster.bench.path import _cpu_ns
from pdcluster.bench.path_engine import Cases
from pdcluster.bench.path_table import format_table


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_cpu_of_every_thread_is_counted_finer_than_a_clock_tick():
    spent: list[float] = []

    def spin() -> None:  # NOTE: 3 ms of this thread's own CPU: less than one of /proc/PID/stat's 10 ms ticks
        t = time.thread_time()
        while time.thread_time() - t < 0.003:
            pass
        spent.append(time.thread_time() - t)

    # NOTE: read while the spinning thread lives: a thread that ended is no longer in /proc/PID/task
    spun = threading.Event()
    done = threading.Event()

    def spin_and_wait() -> None:
        spin()
        spun.set()
        done.wait(10)

    live = threading.Thread(target=spin_and_wait)
    before = _cpu_ns(os.getpid())
    live.start()
    assert spun.wait(10)
    # NOTE: a thread's schedstat counts its running slice when it is switched out (or at a tick): read once it sleeps
    stat = f"/proc/{os.getpid()}/task/{live.native_id}/stat"
    deadline = time.monotonic() + 10
    while Path(stat).read_text().rsplit(")", 1)[1].split()[0] == "R" and time.monotonic() < deadline:
        time.sleep(0.001)
    after = _cpu_ns(os.getpid())
    done.set()
    live.join()
    assert after - before >= spent[-1] * 1e9 * 0.9  # the spinning thread's CPU, to the nanosecond's scale
    assert (after - before) % 10_000_000 != 0  # not in whole ticks


def test_the_table_prints_the_routers_cpu_per_request_beside_the_timeline():
    front = {"ttft_ms_p50": 9.0, "ttft_added_ms": 7.5, "itl_ms_p50": 1.0, "itl_added_ms": 0.3, "tok_s_1": 900.0,
             "ratio_1": 0.8, "tok_s_32": 5000.0, "ratio_32": 0.85, "router_cpu_s_per_1k_tokens": 0.1,
             "router_cpu_s_per_1k_tokens_net": 0.09, "bare_cpu_s_per_1k_tokens": 0.05,
             "router_first_token_ms_p50": 7.0, "router_queue_ms_p50": 2.8, "router_prefill_ms_p50": 3.9,
             "prefill_worker_step_ms_mean": 3.5, "router_cpu_ms_per_request": 4.21,
             "router_cpu_ms_per_request_net": 3.05, "bare_cpu_ms_per_request": 1.45, "engine_ttft_ms_p50": 1.5,
             "engine_step_ms_p50": 0.7}
    figures = {"streams": 32, "models": {"tiny": {"engine": {"ttft_ms_p50": 1.5, "step_ms_p50": 0.7},
                                                  "cluster": {"start_s": 14.0}, "grpc": front}}}
    table = format_table(figures)
    assert "router CPU ms / request (net of idle)" in table
    assert "| tiny | grpc | 1.5 | 9.0 | 7.0 | 2.8 | 3.9 | 3.5 | 4.21 (3.05) | 1.45 |" in table


def test_what_is_added_is_read_against_the_engine_alone_paired_with_the_front():
    # NOTE: the engine alone ran before the cluster (1.5 ms, 0.70 ms) and again beside this front's cases (2.5, 1.1)
    front = {"ttft_ms_p50": 9.0, "ttft_added_ms": 6.5, "itl_ms_p50": 1.4, "itl_added_ms": 0.3, "tok_s_1": 800.0,
             "ratio_1": 0.9, "tok_s_32": 5000.0, "ratio_32": 0.85, "router_cpu_s_per_1k_tokens": 0.1,
             "router_cpu_s_per_1k_tokens_net": 0.09, "bare_cpu_s_per_1k_tokens": 0.05, "worker_step_ms_mean_1": 1.1,
             "engine_ttft_ms_p50": 2.5, "engine_step_ms_p50": 1.1, "engine_step_ms_mean_1": 1.05}
    figures = {"streams": 32, "models": {"tiny": {"engine": {"ttft_ms_p50": 1.5, "step_ms_p50": 0.7,
                                                             "step_ms_mean_1": 0.69},
                                                  "cluster": {"start_s": 14.0}, "grpc": front}}}
    table = format_table(figures)
    assert "| tiny | grpc | 9.0 (2.5) | +6.5 | 1.40 (1.10) | +0.30 | 800 (0.90x) |" in table
    assert "| tiny | grpc | 1.050 | 1.250 | 1.100 | 0.150 |" in table


def test_no_prompt_serves_two_cases():
    # NOTE: a prompt a case saw before is a prefix-cache hit in the next: the N streams once reused the TTFT prompts
    args = argparse.Namespace(ttft_requests=8, itl_rounds=3, one_rounds=5, streams=32)
    prompts = [[i] for i in range(Cases.count(args))]
    cases = Cases.of(prompts, args)
    sizes = [len(cases.warm), len(cases.ttft), len(cases.itl), len(cases.one), len(cases.many)]
    assert sizes == [2, 8, 3, 5, 32]
    seen = [p[0] for c in (cases.warm, cases.ttft, cases.itl, cases.one, cases.many) for p in c]
    assert sorted(seen) == list(range(len(prompts)))


@pytest.mark.parametrize("flag", ["stream_rounds", "ttft_requests", "itl_rounds", "one_rounds"])
def test_a_case_of_no_runs_is_refused_naming_its_flag(flag):
    args = argparse.Namespace(models="tiny", stream_rounds=1, ttft_requests=8, itl_rounds=3, one_rounds=5)
    setattr(args, flag, 0)
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be at least 1"):
        path.run(args)
