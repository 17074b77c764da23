"""`pdcluster plan`: profile, simulate, search, validate, scale (each prints its figures and saves them as JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdcluster.bench.report import emit

FMT = argparse.ArgumentDefaultsHelpFormatter
PLAN_HELP = """Size a cluster before buying it: profile the engine, simulate the cluster, search prefill:decode counts.

examples:
  pdcluster plan profile                                  # time engine steps here -> results/profile_cpu.json
  pdcluster plan describe --profile h100:llama-3.1-70b    # the ESTIMATED roofline step model of a GPU worker
  pdcluster plan simulate --config deploy/bench-disagg.yaml --workload mixed --rate 0.5 --num-requests 60
  pdcluster plan search --profile h100 --workload summarization --rate 100 --slo-ttft-ms 300 --slo-itl-ms 15
  pdcluster plan goodput --profile h200-measured --gpus 8 --workload sharegpt --slo-ttft-ms 500 --slo-itl-ms 50
  pdcluster plan validate --measured results/bench_compare.json --calibrate-on "disaggregated 1P+1D@0.4"
  pdcluster plan scale                                    # 1,024 H100s, 50,000 requests: wall seconds
"""
CPU_PROFILE = "results/profile_cpu.json"


def log(msg: str) -> None:
    print(f"[plan] {msg}", file=sys.stderr, flush=True)


def _workload_args(p: argparse.ArgumentParser, rate: float, n: int) -> None:
    from pdcluster.bench.workloads import WORKLOADS

    g = p.add_argument_group("workload (pdcluster/bench/workloads.py)")
    g.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS))
    g.add_argument("--rate", type=float, default=rate, help="requests per second (Poisson)")
    g.add_argument("--num-requests", type=int, default=n)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-scale", type=float, default=1.0)
    g.add_argument("--output-scale", type=float, default=1.0)
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-itl-ms", type=float, default=150.0, help="per-request mean inter-token latency (TPOT)")


def _profile_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--profile", default=default, help=f"a profile JSON (`plan profile` writes {CPU_PROFILE}) or "
                   "h100 / h200 (ESTIMATED roofline), optionally with a model: h100:llama-3.1-70b")
    p.add_argument("--overheads", default=None, help="JSON with cluster overheads (e.g. results/plan_validate.json "
                   "after a calibrated `plan validate`); default: zero for a CPU profile, small fixed ones for GPUs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def add_arguments(sub: Any) -> None:
    """Register `plan` and its subcommands on the top-level subparsers."""
    plan = sub.add_parser("plan", help="profile the engine, simulate a cluster, size P:D for SLOs, validate, scale",
                          description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    psub = plan.add_subparsers(dest="plan", required=True)
    p = psub.add_parser("profile", help="time real engine steps here (1 thread, 1 core) and fit the step model",
                        formatter_class=FMT)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--core", type=int, default=None, help="core to pin to (default: the last allowed)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=CPU_PROFILE)
    p.add_argument("--json", action="store_true")

    d = psub.add_parser("describe", help="print a profile's step model (measured, or ESTIMATED for a GPU)",
                        formatter_class=FMT)
    d.add_argument("--profile", default=CPU_PROFILE, help="a profile JSON, or h100 / h200[:model]")
    d.add_argument("--json", action="store_true")

    s = psub.add_parser("simulate", help="predict TTFT/ITL of a workload on a cluster", formatter_class=FMT)
    _profile_arg(s, CPU_PROFILE)
    s.add_argument("--config", default=None, help="deploy YAML (default: deploy/local.yaml for a CPU profile, "
                   "deploy/gpu-cluster.yaml for a GPU one, with --prefill/--decode/--colocated replicas)")
    s.add_argument("--prefill", type=int, default=None)
    s.add_argument("--decode", type=int, default=None)
    s.add_argument("--colocated", type=int, default=None, help="colocated workers (sets mode colocated)")
    s.add_argument("--routing", choices=("prefix_aware", "round_robin"), default=None)
    s.add_argument("--out", default="results/plan_simulate.json")
    _workload_args(s, 0.5, 60)

    r = psub.add_parser("search", help="the cheapest P:D meeting the SLOs at a rate; writes a deploy YAML",
                        formatter_class=FMT)
    _profile_arg(r, "h100")
    r.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    r.add_argument("--max-gpus", type=int, default=512)
    r.add_argument("--template", default=None, help="deploy YAML to start from (default: by profile kind)")
    r.add_argument("--yaml", default="results/planned.yaml", help="where to write the planned deploy YAML")
    r.add_argument("--out", default="results/plan_search.json")
    _workload_args(r, 100.0, 3000)

    g = psub.add_parser("goodput", help="on N GPUs: every P:D split's and colocated goodput (simulated)",
                        formatter_class=FMT)
    _profile_arg(g, "h200-measured")
    g.add_argument("--gpus", type=int, default=8, help="GPUs to split (workers x the profile's GPUs per worker)")
    g.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    g.add_argument("--template", default=None, help="deploy YAML of the workers (default: by profile kind)")
    g.add_argument("--out", default="results/plan_goodput.json")
    _workload_args(g, 4.0, 600)
    v = psub.add_parser("validate", help="simulator vs measured `bench serve` runs (TTFT/ITL p50/p99)",
                        formatter_class=FMT)
    _profile_arg(v, CPU_PROFILE)
    v.add_argument("--measured", nargs="+", default=["results/bench_serve.json"], help="bench JSON file(s)")
    v.add_argument("--calibrate-on", default=None, metavar="LABEL@RATE", help="fit the overheads to this run "
                   "(it is left out of the table)")
    v.add_argument("--out", default="results/plan_validate.json")

    c = psub.add_parser("scale", help="simulate a 1,000+ GPU cluster: how long the simulation takes",
                        formatter_class=FMT)
    _profile_arg(c, "h100")
    c.add_argument("--prefill", type=int, default=200)
    c.add_argument("--decode", type=int, default=824)
    c.add_argument("--out", default="results/plan_scale.json")
    _workload_args(c, 10000.0, 50000)


def _profile(args: argparse.Namespace) -> Any:
    from pdcluster.plan.hardware import resolve_profile

    try:
        return resolve_profile(args.profile)
    except FileNotFoundError:
        raise ValueError(f"--profile: {args.profile!r} is neither a profile JSON (`pdcluster plan profile` writes "
                         f"one) nor h100 / h200") from None


def _overheads(args: argparse.Namespace, profile: Any) -> Any:
    from pdcluster.plan.simulator import GPU_OVERHEADS, Overheads

    if args.overheads:
        with open(args.overheads) as f:
            data = json.load(f)
        return Overheads.model_validate(data.get("overheads", data))
    return GPU_OVERHEADS if profile.on_gpu else Overheads()


def _workload(args: argparse.Namespace) -> Any:
    from pdcluster.bench.workloads import build

    return build(args.workload, args.rate, args.num_requests, args.seed, input_scale=args.input_scale,
                 output_scale=args.output_scale)


def _config(args: argparse.Namespace, profile: Any) -> Any:
    from pdcluster.config import ClusterConfig
    from pdcluster.plan.plan_yaml import CPU_TEMPLATE, GPU_TEMPLATE

    cfg = ClusterConfig.from_yaml(args.config or (GPU_TEMPLATE if profile.on_gpu else CPU_TEMPLATE))
    if getattr(args, "colocated", None):
        cfg.mode, cfg.colocated.replicas = "colocated", args.colocated
    for role in ("prefill", "decode"):
        if getattr(args, role, None):
            getattr(cfg, role).replicas = getattr(args, role)
    if getattr(args, "routing", None):
        cfg.router.routing = args.routing
    return cfg


def _summary_table(f: dict[str, Any]) -> str:
    s = f["summary"]
    return (f"{f['profile']} | {f['cluster']} | {f['workload']}\n"
            f"predicted: TTFT p50 {s['ttft_ms']['p50']:.0f} / p99 {s['ttft_ms']['p99']:.0f} ms; ITL p50 "
            f"{s['itl_ms']['p50']:.1f} / p99 {s['itl_ms']['p99']:.1f} ms; TPOT p50 {s['tpot_ms']['p50']:.1f} ms; "
            f"{s['req_per_s']} req/s, {s['output_tok_per_s']} tok/s; prefix hit rate {s['prefix_hit_rate']}; "
            f"prefill skipped {s['prefill_skipped']}; SLO attainment {s['slo_attainment']:.3f}\n"
            f"placements: {', '.join(f'{k} {v}' for k, v in sorted(s.get('placements', {}).items()))}\n"
            f"simulated {s['duration_s']} s of {s['sim']['workers']} workers in {s['sim']['wall_s']} s "
            f"({s['sim']['events']} events)")


def _simulate(args: argparse.Namespace, out_table: bool = True) -> dict[str, Any]:
    import time

    from pdcluster.plan.sim_report import Timings
    from pdcluster.plan.simulator import ClusterShape, Simulator

    prof = _profile(args)
    cfg = _config(args, prof)
    t0 = time.perf_counter()
    wl = _workload(args)
    built = time.perf_counter() - t0
    shape = ClusterShape.from_config(cfg, prof)
    sim = Simulator(shape, prof, _overheads(args, prof))
    sim.run(wl)
    pools = ", ".join(f"{p.replicas} {role}" for role, p in shape.pools.items())
    return {"profile": f"{prof.hardware} / {prof.model}{' (ESTIMATED)' if prof.estimated else ''}",
            "cluster": f"{cfg.mode}, {cfg.router.routing}: {pools} ({shape.num_workers * prof.gpus_per_worker} "
                       f"{'GPUs' if prof.on_gpu else 'cores'})",
            "workload": wl.describe(), "workload_build_s": round(built, 2), "overheads": sim.ov.model_dump(),
            "summary": Timings(sim).summary(args.slo_ttft_ms, args.slo_itl_ms)}


def run(args: argparse.Namespace) -> int:
    """Dispatch `pdcluster plan SUBCOMMAND`."""
    if args.plan == "profile":
        from pdcluster.plan.measure import profile_here
        from pdcluster.plan.profile import describe

        prof, rows = profile_here(args.model, args.threads, args.core, args.repeats, log)
        prof.save(args.out)
        steps_out = args.out.removesuffix(".json") + "_steps.json"
        with open(steps_out, "w") as f:
            json.dump(rows, f)
        log(f"saved {args.out} and the measured steps in {steps_out}")
        print(prof.model_dump_json(indent=2) if args.json else describe(prof))
        return 0
    if args.plan == "describe":
        from pdcluster.plan.profile import describe

        prof = _profile(args)
        print(prof.model_dump_json(indent=2) if args.json else describe(prof))
        return 0
    if args.plan in ("simulate", "scale"):
        if args.plan == "scale":
            args.config, args.colocated, args.routing = None, None, None
        fig = _simulate(args)
        if args.plan == "scale":
            s = fig["summary"]
            log(f"scale: {s['sim']['workers']} workers, {s['completed']} requests, {s['duration_s']} simulated s, "
                f"{s['sim']['wall_s']} wall s")
        return emit("plan", fig, args.out, args.json, _summary_table)
    if args.plan == "search":
        from pdcluster.plan.search_cli import run_search

        return run_search(args, _profile(args), _overheads, _workload(args), log)
    if args.plan == "goodput":
        from pdcluster.plan.goodput import run_goodput

        prof = _profile(args)
        return run_goodput(args, prof, _overheads(args, prof), log)
    if args.plan == "validate":
        from pdcluster.plan.validate import format_table, validate

        fig = validate(args.measured, _profile(args), args.calibrate_on)
        return emit("plan", fig, args.out, args.json, format_table)
    return 2
