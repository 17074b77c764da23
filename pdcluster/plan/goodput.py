"""`pdcluster plan goodput`: on a fixed number of GPUs, the goodput of every prefill:decode split and of colocated
workers, in the simulator (DistServe's comparison: the highest request rate at which >= --attainment of requests
meet both the TTFT and the TPOT SLO).

For each shape the rate is doubled from --rate until attainment falls below the target, then bisected 6 times;
each trial is a full simulation of the workload at that rate over the same span of time (--num-requests at --rate,
proportionally more requests at higher rates). Every figure it prints is PREDICTED.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from pdcluster.bench.report import emit
from pdcluster.bench.workloads import build
from pdcluster.plan.profile import Profile
from pdcluster.plan.search import Slo
from pdcluster.plan.search_cli import _shapes
from pdcluster.plan.sim_report import Timings
from pdcluster.plan.simulator import ClusterShape, Overheads, Simulator

BISECTIONS = 6
MAX_DOUBLINGS = 10


def attainment(shape: ClusterShape, profile: Profile, ov: Overheads, args: argparse.Namespace, rate: float,
               slo: Slo) -> float:
    """SLO attainment of `shape` at `rate` req/s (one simulation)."""
    # NOTE: every trial spans the same time (--num-requests at --rate): at a higher rate more requests, so each
    # trial measures a steady load, not one burst of a fixed count
    n = max(1, round(args.num_requests * rate / args.rate))
    wl = build(args.workload, rate, n, args.seed, input_scale=args.input_scale, output_scale=args.output_scale)
    sim = Simulator(shape, profile, ov)
    sim.run(wl)
    return float(Timings(sim).summary(slo.ttft_ms, slo.itl_ms)["slo_attainment"])


def max_rate(ok: Callable[[float], bool], start: float) -> float:
    """The highest rate with ok(rate), to 1/2**BISECTIONS of the bracket (0 when even start/64 fails)."""
    lo, hi = 0.0, start
    for _ in range(MAX_DOUBLINGS):
        if not ok(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo  # NOTE: start x 2**MAX_DOUBLINGS still met: say that much, not more
    if lo == 0.0:
        lo, hi = 0.0, start
        floor = start / 64
        if not ok(floor):
            return 0.0
        lo = floor
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def run_goodput(args: argparse.Namespace, profile: Profile, ov: Overheads, log: Callable[[str], None]) -> int:
    from pdcluster.plan import plan_yaml

    started = time.perf_counter()
    slo = Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, attainment=args.attainment)
    template = args.template or (plan_yaml.GPU_TEMPLATE if profile.on_gpu else plan_yaml.CPU_TEMPLATE)
    # NOTE: the router and the engines act on the SLOs (the ITL budget, the SLO placements), as `plan search` sets
    disagg, colo = (dataclasses.replace(sh, slo_itl_ms=slo.itl_ms, slo_ttft_ms=slo.ttft_ms)
                    for sh in _shapes(template, profile)[1:])
    workers = args.gpus // profile.gpus_per_worker
    if workers < 2:
        raise ValueError(f"--gpus: {args.gpus} GPUs hold {workers} worker(s) of {profile.gpus_per_worker} GPUs; "
                         "a disaggregated split needs 2")
    shapes = {f"{p}P:{workers - p}D": disagg.with_replicas(prefill=p, decode=workers - p) for p in range(1, workers)}
    shapes[f"{workers} colocated"] = colo.with_replicas(colocated=workers)
    rows = []
    for name, shape in shapes.items():
        def meets(rate: float, shape: ClusterShape = shape) -> bool:
            return attainment(shape, profile, ov, args, rate, slo) >= slo.attainment

        rate = max_rate(meets, args.rate)
        rows.append({"shape": name, "mode": shape.mode, "goodput_req_per_s": round(rate, 3),
                     "per_gpu": round(rate / args.gpus, 3)})
        log(f"{name}: goodput {rate:.2f} req/s ({rate / args.gpus:.2f} per GPU)")
    best = max((r for r in rows if r["mode"] == "disaggregated"), key=lambda r: r["goodput_req_per_s"])
    col = next(r for r in rows if r["mode"] == "colocated")
    fig = {"profile": f"{profile.hardware} / {profile.model}{' (ESTIMATED)' if profile.estimated else ''}",
           "transfer_gb_s": profile.transfer.bandwidth_gb_s, "gpus": args.gpus,
           "workload": build(args.workload, args.rate, args.num_requests, args.seed, input_scale=args.input_scale,
                             output_scale=args.output_scale).describe() + " per trial span (scaled with the rate)",
           "slo": slo.model_dump(), "shapes": rows, "best_disaggregated": best, "colocated": col,
           "ratio": (round(best["goodput_req_per_s"] / col["goodput_req_per_s"], 2) if col["goodput_req_per_s"]
                     else None),
           "predicted": True, "wall_s": round(time.perf_counter() - started, 1)}
    return emit("plan", fig, args.out, args.json, format_table)


def format_table(f: dict[str, Any]) -> str:
    lines = [f"{f['profile']} (KV {f['transfer_gb_s']:g} GB/s) | {f['workload']} | SLO TTFT {f['slo']['ttft_ms']:g} ms,"
             f" TPOT {f['slo']['itl_ms']:g} ms, >= {f['slo']['attainment']:.0%} | PREDICTED",
             f"{'shape':16}{'goodput req/s':>15}{'per GPU':>10}"]
    lines += [f"{r['shape']:16}{r['goodput_req_per_s']:15.2f}{r['per_gpu']:10.3f}" for r in f["shapes"]]
    b, c = f["best_disaggregated"], f["colocated"]
    lines.append(f"best disaggregated {b['shape']}: {b['goodput_req_per_s']:.2f} req/s; colocated: "
                 f"{c['goodput_req_per_s']:.2f} req/s; ratio {f['ratio']}")
    return "\n".join(lines)
