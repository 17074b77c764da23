"""`pdcluster plan search`: run the search, print every split tried, write the planned deploy YAML."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable
from typing import Any

from pdcluster.bench.report import emit
from pdcluster.bench.workloads import Workload
from pdcluster.config import ClusterConfig
from pdcluster.plan import plan_yaml
from pdcluster.plan.profile import Profile
from pdcluster.plan.search import Planner, Slo, Trial
from pdcluster.plan.simulator import ClusterShape


def _shapes(template: str, profile: Profile) -> tuple[ClusterConfig, ClusterShape, ClusterShape]:
    """The template as a disaggregated shape, and its colocated twin (the decode pool's settings)."""
    cfg = ClusterConfig.from_yaml(template)
    cfg.mode = "disaggregated"
    colo = cfg.model_copy(deep=True)
    colo.mode, colo.colocated = "colocated", cfg.decode.model_copy()
    return cfg, ClusterShape.from_config(cfg, profile), ClusterShape.from_config(colo, profile)


def _figures(t: Trial) -> str:
    s = t.summary
    return (f"TTFT p50 {s['ttft_ms']['p50']:.0f} / p99 {s['ttft_ms']['p99']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f}"
            f" / p99 {s['itl_ms']['p99']:.1f} ms, TPOT p99 {s['tpot_ms']['p99']:.1f} ms, attainment {t.attainment:.3f}")


def header(profile: Profile, wl: Workload, slo: Slo, best: Trial | None, same: Trial | None,
           fewest: Trial | None, chosen: str) -> list[str]:
    """The comment block on top of a planned YAML: how it was made and what it is predicted to do."""
    cmd = "pdcluster " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else "pdcluster plan search ..."
    lines = ["Produced by `pdcluster plan search` (simulated, not measured); re-run the command to re-plan:",
             f"  {cmd}",
             f"Profile: {profile.hardware} / {profile.model}, "
             + ("ESTIMATED from published specs (roofline)" if profile.estimated else "measured"),
             f"Workload: {wl.describe()}",
             f"SLOs: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.itl_ms:g} ms for >= {slo.attainment:.0%} of requests"]
    if best is not None:
        lines += [f"{'Plan' if chosen == 'disaggregated' else 'Cheapest disaggregated'}: {best.prefill} prefill + "
                  f"{best.decode} decode workers = {best.gpus} GPUs ({profile.gpus_per_worker} per worker)",
                  f"  predicted: {_figures(best)}"]
    if same is not None:
        lines.append(f"Colocated on the same {same.gpus} GPUs: attainment {same.attainment:.3f}")
    if fewest is not None:
        lines += [f"{'Plan' if chosen == 'colocated' else 'Cheapest colocated'}: {fewest.decode} colocated workers = "
                  f"{fewest.gpus} GPUs", f"  predicted: {_figures(fewest)}"]
    return lines


def format_table(f: dict[str, Any]) -> str:
    lines = [f"{f['profile']} | {f['workload']} | SLO TTFT {f['slo']['ttft_ms']:g} ms, TPOT {f['slo']['itl_ms']:g} ms,"
             f" >= {f['slo']['attainment']:.0%}",
             f"{'mode':14}{'P':>5}{'D':>6}{'GPUs':>7}{'attain':>8}{'TTFT ok':>9}{'TPOT ok':>9}"
             f"{'TTFT p99':>10}{'ITL p99':>9}"]
    for t in f["trials"]:
        s = t["summary"]
        lines.append(f"{t['mode']:14}{t['prefill']:5}{t['decode']:6}{t['gpus']:7}{t['attainment']:8.3f}"
                     f"{t['ttft_ok']:9.3f}{t['tpot_ok']:9.3f}{s['ttft_ms']['p99']:10.0f}{s['itl_ms']['p99']:9.1f}")
    b, c, few = f["best"], f.get("colocated_same"), f.get("colocated_fewest")
    lines.append(f"cheapest disaggregated: {b['prefill']}P:{b['decode']}D = {b['gpus']} GPUs" if b else
                 "no disaggregated split within --max-gpus meets the SLOs")
    if c:
        lines.append(f"colocated on the same {c['gpus']} GPUs: attainment {c['attainment']:.3f}")
    lines.append(f"cheapest colocated: {few['decode']} workers = {few['gpus']} GPUs" if few else
                 "no colocated size within --max-gpus meets the SLOs")
    lines.append(f"plan: {f['chosen']} -> {f['yaml']}" if f["chosen"] else "no plan written")
    lines.append(f"{len(f['trials'])} simulations in {f['wall_s']:.1f} s")
    return "\n".join(lines)


def planned_model(profile: Profile) -> str | None:
    """The model a plan of TP workers names: `random:<arch>` of the profile's model (the template names an 8B
    directory); None (the template's) for a worker of one GPU or a model without a random twin."""
    from pdcluster.plan.hardware import MODELS  # NOTE: its keys are engine/random_model.py's architectures

    arch = profile.model.lower()
    return f"random:{arch}" if profile.gpus_per_worker > 1 and profile.on_gpu and arch in MODELS else None


def run_search(args: argparse.Namespace, profile: Profile, overheads: Callable[[argparse.Namespace, Any], Any],
               wl: Workload, log: Callable[[str], None]) -> int:
    import time

    started = time.perf_counter()
    template = args.template or (plan_yaml.GPU_TEMPLATE if profile.on_gpu else plan_yaml.CPU_TEMPLATE)
    slo = Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, attainment=args.attainment)
    # NOTE: the planned YAML sets the router's SLOs to these (`router=targets` below), and the router and the engines
    # act on them (the ITL budget, the SLO placements): the simulated cluster does the same
    targets = {"slo_itl_ms": slo.itl_ms, "slo_ttft_ms": slo.ttft_ms}
    shape, colo = (dataclasses.replace(sh, slo_itl_ms=slo.itl_ms, slo_ttft_ms=slo.ttft_ms)
                   for sh in _shapes(template, profile)[1:])
    planner = Planner(shape, colo, profile, overheads(args, profile), wl, slo, args.max_gpus, log)
    best = planner.cheapest()
    same, fewest = planner.colocated_for(best.prefill + best.decode if best else planner.max_workers)
    # NOTE: the plan is whichever mode meets the SLOs on fewer GPUs (disaggregated on a tie)
    chosen = "colocated" if fewest and (best is None or fewest.gpus < best.gpus) else "disaggregated"
    plan = fewest if chosen == "colocated" else best
    if plan is not None:
        replicas = {"colocated": plan.decode} if chosen == "colocated" else {"prefill": plan.prefill,
                                                                              "decode": plan.decode}
        text = plan_yaml.render(template, chosen, replicas, header(profile, wl, slo, best, same, fewest, chosen),
                                profile.gpus_per_worker, router=targets, model=planned_model(profile),
                                gpu_memory_gb=profile.gpu_memory_gb)
        loaded = plan_yaml.write(args.yaml, text)
        log(f"wrote {args.yaml}: loads as {loaded.mode} with "
            + ", ".join(f"{p.replicas} {role}" for role, p in loaded.pools().items()))
    trials = [{"mode": mode, **t.as_dict()} for (mode, _, _), t in planner.trials.items()]
    fig = {"profile": f"{profile.hardware} / {profile.model}{' (ESTIMATED)' if profile.estimated else ''}",
           "workload": wl.describe(), "slo": slo.model_dump(), "max_gpus": args.max_gpus,
           "best": best.as_dict() if best else None, "chosen": chosen if plan else None,
           "yaml": args.yaml if plan else None,
           "colocated_same": same.as_dict() if same else None, "colocated_fewest": fewest.as_dict() if fewest else None,
           "trials": trials, "wall_s": round(time.perf_counter() - started, 2)}
    emit("plan", fig, args.out, args.json, format_table)
    return 0 if plan is not None else 1
