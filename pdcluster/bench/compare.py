"""`pdcluster bench compare`: the same workload on the configurations users choose between, in one command.

1. Disaggregated vs colocated with the same resources (deploy/bench-disagg.yaml: one prefill worker on core 0,
   one decode worker on core 1; deploy/bench-colocated.yaml: two workers that do both, on cores 0 and 1), on a
   mixed long/short workload: does keeping prefills off the decode core cut the inter-token latency tail?
2. Prefix-aware vs round-robin routing (same cluster, only `router.routing` differs) on the shared-system-prompt
   multi-turn workload: does sending a conversation back to the worker that caches it cut the TTFT?
Each configuration is started fresh in a child process and stopped before the next, so they never share a core.
Prints the ratios the issue asks for, saves every run (`--out`), and plots both comparisons.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from pdcluster.bench import plots
from pdcluster.bench.serve import add_workload_arguments, finish, rates_of, sweep


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
    p.add_argument("--out", default="results/bench_compare.json")


def _cluster_runs(config: str, routing: str | None, label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdcluster.bench.cluster_proc import load, serving

    cfg = load(config, routing)
    with serving(cfg, label) as addr:
        return sweep(addr, args, label, {"config": config, "mode": cfg.mode, "routing": cfg.router.routing})


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def mode_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disaggregated vs colocated at every rate: the runs, and per rate the ratios."""
    runs = (_cluster_runs(args.disagg_config, None, "disaggregated 1P+1D", args)
            + _cluster_runs(args.colocated_config, None, "colocated 2x", args))
    rows = []
    for d in (r for r in runs if r["mode"] == "disaggregated"):
        c = next(r for r in runs if r["mode"] == "colocated" and r["workload"]["rate"] == d["workload"]["rate"])
        ds, cs = d["summary"], c["summary"]
        rows.append({"rate": d["workload"]["rate"], "workload": d["workload"]["name"],
                     "itl_p99_ms": [ds["itl_ms"]["p99"], cs["itl_ms"]["p99"]],
                     "ttft_p50_ms": [ds["ttft_ms"]["p50"], cs["ttft_ms"]["p50"]],
                     "itl_p99_ratio": _ratio(ds["itl_ms"]["p99"], cs["itl_ms"]["p99"]),
                     "ttft_p50_ratio": _ratio(ds["ttft_ms"]["p50"], cs["ttft_ms"]["p50"]),
                     "tpot_p99_ratio": _ratio(ds["tpot_ms"]["p99"], cs["tpot_ms"]["p99"]),
                     "slo_attainment": [ds["slo_attainment"], cs["slo_attainment"]]})
    return runs, rows


def routing_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prefix-aware vs round-robin on the shared-prompt workload: the runs, and per rate the ratios."""
    rargs = copy.copy(args)
    rargs.workload, rargs.rates, rargs.num_requests = args.routing_workload, args.routing_rates, \
        args.routing_num_requests
    runs = (_cluster_runs(args.routing_config, "prefix_aware", "prefix-aware", rargs)
            + _cluster_runs(args.routing_config, "round_robin", "round-robin", rargs))
    rows = []
    for a in (r for r in runs if r["routing"] == "prefix_aware"):
        b = next(r for r in runs if r["routing"] == "round_robin" and r["workload"]["rate"] == a["workload"]["rate"])
        sa, sb = a["summary"], b["summary"]
        rows.append({"rate": a["workload"]["rate"], "workload": a["workload"]["name"],
                     "ttft_p50_ms": [sa["ttft_ms"]["p50"], sb["ttft_ms"]["p50"]],
                     "ttft_p50_ratio": _ratio(sa["ttft_ms"]["p50"], sb["ttft_ms"]["p50"]),
                     "ttft_p99_ratio": _ratio(sa["ttft_ms"]["p99"], sb["ttft_ms"]["p99"]),
                     "prefix_hit_rate": [sa["prefix_hit_rate"], sb["prefix_hit_rate"]],
                     "slo_attainment": [sa["slo_attainment"], sb["slo_attainment"]]})
    return runs, rows


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


def run(args: argparse.Namespace) -> int:
    rates_of(args.rates)  # NOTE: bad input fails here, before a cluster is started for it
    rates_of(args.routing_rates, "--routing-rates")
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
