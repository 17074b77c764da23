"""`pdcluster bench compare --vs vllm-cpu`: pdcluster against vLLM-CPU on the same cores, same prompts, same rates.

1. pdcluster from `--disagg-config` (deploy/bench-disagg.yaml: 1 prefill + 1 decode worker, one pinned core each)
   in a child process with its OpenAI HTTP front on; every workload of `--vs-workloads` at its rate; stopped.
2. vLLM-CPU from its virtualenv (pdcluster/bench/vllm_proc.py) on the same cores (`--vllm-cores`), serving the
   same weights exported as an HF directory (pdcluster/bench/hf_export.py); the same workloads; stopped.
Both are driven by the same client over the OpenAI streaming API (pdcluster/bench/openai_client.py), with the
same seeds, so each workload sends the very same token ids at the same arrival times to both.
Per workload: TTFT p50, ITL p50, ITL p99 and SLO attainment side by side, with the goals as ratios:
attainment ≥ vLLM's, ITL p99 ≤ 0.5× vLLM's, TTFT p50 ≤ vLLM's.
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
    venv = args.vllm_venv or DEFAULT_VENV
    vllm_python(venv)
    return venv


def _runs(target: Target, args: argparse.Namespace, label: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    runs = []
    for name, rate in workloads_of(args.vs_workloads):
        wargs = copy.copy(args)
        wargs.workload, wargs.rates = name, f"{rate:g}"
        runs += sweep(target, wargs, label, meta)
    return runs


def vllm_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """pdcluster, then vLLM-CPU, on every workload: the runs, and per workload the figures and ratios."""
    from pdcluster.bench.cluster_proc import load, serving_endpoints
    from pdcluster.bench.hf_export import DEFAULT_DIR, export
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
    log("compare", f"starting vLLM-CPU from {venv} on cores {args.vllm_cores} (~1.5 min)")
    with vllm_serving(venv, model_dir, cores=args.vllm_cores, kv_cache_gb=args.vllm_kv_gb,
                      extra_args=args.vllm_arg) as base_url:
        theirs = _runs(Target("openai", base_url), args, THEIRS, {"server": "vllm-cpu", "venv": venv})
    return ours + theirs, rows(ours, theirs)


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
            "ttft_p50_le_vllm": row["ttft_p50_ratio"] is not None and row["ttft_p50_ratio"] <= 1.0,
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
            f"{r['ttft_p50_ms'][0]:.0f} vs {r['ttft_p50_ms'][1]:.0f} ms (ratio {r['ttft_p50_ratio']}, goal <= 1: "
            f"{_yes(g['ttft_p50_le_vllm'])}); ITL p50 {r['itl_p50_ms'][0]:.0f} vs {r['itl_p50_ms'][1]:.0f} ms")
    return "\n".join(lines)
