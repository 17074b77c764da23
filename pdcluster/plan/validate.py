"""`pdcluster plan validate`: the simulator's TTFT and ITL against real `pdcluster bench serve` runs.

Each run of a bench JSON names its config YAML and its workload's parameters: the workload is rebuilt
(`pdcluster.bench.workloads.build`, same seed and salt: the same sessions, lengths and arrival times), simulated on
that config with the profile, and its p50/p99 TTFT and ITL set against what the client measured.

Calibration (optional, `--calibrate-on LABEL@RATE`): the cluster on this machine does work the engine profile does
not (router, Ray, gRPC, Redis and the client share the two cores with the workers). One run, never one in the table,
fits four constants: a step-time factor (measured / predicted median ITL of the steady gaps), then the median
excess of TTFT (→ `router_s`) and of the first decode gap (→ `decode_call_s`).
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from pdcluster.bench.workloads import Workload, build
from pdcluster.config import ClusterConfig
from pdcluster.plan.profile import Profile
from pdcluster.plan.sim_report import Timings
from pdcluster.plan.simulator import ClusterShape, Overheads, Simulator

METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))
TOLERANCE_PCT = 25.0


def run_key(run: dict[str, Any]) -> str:
    return f"{run['label']}@{run['workload']['rate']:g}"


def workload_of(run: dict[str, Any]) -> Workload:
    """The run's workload, rebuilt from its stored parameters."""
    w = run["workload"]
    return build(w["name"], w["rate"], w["num_requests"], int(w.get("seed", 0)),
                 input_scale=w.get("input_scale", 1.0), output_scale=w.get("output_scale", 1.0),
                 salt=int(w.get("salt", 0)), think_scale=w.get("think_scale", 1.0))


def simulate_run(run: dict[str, Any], profile: Profile, ov: Overheads) -> Timings:
    cfg = ClusterConfig.from_yaml(run["config"])
    if run.get("routing"):
        cfg.router.routing = run["routing"]
    sim = Simulator(ClusterShape.from_config(cfg, profile), profile, ov)
    sim.run(workload_of(run))
    return Timings(sim)


def _steady_gaps(reqs: list[dict[str, Any]]) -> list[float]:
    return [g for r in reqs for g in r["itl_ms"][1:]]


def calibrate(run: dict[str, Any], profile: Profile) -> Overheads:
    """Fit the overheads to one measured run (see the module docstring)."""
    measured = [r for r in run["requests"] if not r.get("error")]
    t = simulate_run(run, profile, Overheads())
    scale = statistics.median(_steady_gaps(measured)) / statistics.median(_steady_gaps(t.records()))
    t = simulate_run(run, profile, Overheads(step_scale=scale))
    pred = {(r["session"], r["turn"]): r for r in t.records()}
    pairs = [(m, pred[(m["session"], m["turn"])]) for m in measured if (m["session"], m["turn"]) in pred]
    router = statistics.median(m["ttft_ms"] - p["ttft_ms"] for m, p in pairs) / 1e3
    # NOTE: only disaggregated requests have a decode call between their first and second token
    firsts = [m["itl_ms"][0] - p["itl_ms"][0] for m, p in pairs if m["itl_ms"] and p["itl_ms"] and p["prefill_worker"]]
    call = statistics.median(firsts) / 1e3 if firsts else 0.0
    return Overheads(step_scale=round(scale, 4), router_s=round(max(0.0, router), 5),
                     decode_call_s=round(max(0.0, call), 5), calibrated_from=f"{run_key(run)} in {run['config']}")


def compare(run: dict[str, Any], t: Timings) -> dict[str, Any]:
    """One table row: the run's identity and each metric predicted vs measured."""
    slo = run.get("slo", {"ttft_ms": 2000.0, "itl_ms": 150.0})
    pred = t.summary(slo["ttft_ms"], slo["itl_ms"])
    meas = run["summary"]
    row: dict[str, Any] = {"run": run_key(run), "config": run["config"], "mode": run.get("mode", ""),
                           "routing": run.get("routing", ""), "workload": run["workload"]["name"],
                           "rate": run["workload"]["rate"], "requests": meas.get("completed", 0)}
    errs = []
    for metric, q in METRICS:
        p, m = pred[metric][q], meas[metric][q]
        err = (p - m) / m * 100 if m else 0.0
        errs.append(abs(err))
        row[f"{metric[:-3]}_{q}"] = {"predicted": p, "measured": m, "error_pct": round(err, 1)}
    row["slo_attainment"] = {"predicted": pred["slo_attainment"], "measured": meas.get("slo_attainment")}
    row["max_abs_error_pct"] = round(max(errs), 1)
    row["within_tolerance"] = max(errs) <= TOLERANCE_PCT
    return row


def validate(paths: list[str], profile: Profile, calibrate_on: str | None = None) -> dict[str, Any]:
    """Every run of the bench JSON files, simulated and compared; calibrated first on `calibrate_on` if given."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            runs += json.load(f)["runs"]
    ov = Overheads()
    calib_run = None
    if calibrate_on:
        calib_run = next((r for r in runs if run_key(r) == calibrate_on), None)
        if calib_run is None:
            raise SystemExit(f"--calibrate-on: no run {calibrate_on!r}; runs: {[run_key(r) for r in runs]}")
        ov = calibrate(calib_run, profile)
    rows = [compare(r, simulate_run(r, profile, ov)) for r in runs if r is not calib_run]
    configs_ok = sorted({r["config"] for r in rows if r["within_tolerance"]})
    return {"profile": profile.hardware, "profile_model": profile.model, "overheads": ov.model_dump(),
            "calibration_run": run_key(calib_run) if calib_run else None, "tolerance_pct": TOLERANCE_PCT,
            "rows": rows, "runs_within_tolerance": sum(r["within_tolerance"] for r in rows),
            "configs_within_tolerance": configs_ok, "sources": paths}


def format_table(f: dict[str, Any]) -> str:
    """The validation table: predicted / measured (error %) per metric and run."""
    ov = f["overheads"]
    lines = [f"simulator vs measured ({f['profile']}, {f['profile_model']}); tolerance {f['tolerance_pct']:g}%",
             (f"calibrated on {f['calibration_run']} (not in the table): step x{ov['step_scale']:.3f}, router "
              f"{ov['router_s'] * 1e3:.1f} ms, decode call {ov['decode_call_s'] * 1e3:.1f} ms")
             if f["calibration_run"] else "not calibrated: engine profile and transfer model only",
             "each cell: predicted/measured (error); SLO: share of requests meeting both SLOs, predicted/measured",
             f"{'run':38} {'workload':14} {'TTFT p50 ms':>20} {'TTFT p99 ms':>20} {'ITL p50 ms':>18} "
             f"{'ITL p99 ms':>18} {'SLO':>10}  ok"]
    for r in f["rows"]:
        cells = []
        for key, width in (("ttft_p50", 20), ("ttft_p99", 20), ("itl_p50", 18), ("itl_p99", 18)):
            c = r[key]
            cells.append(f"{c['predicted']:.0f}/{c['measured']:.0f} ({c['error_pct']:+.0f}%)".rjust(width))
        ok = "yes" if r["within_tolerance"] else "no"
        att = r["slo_attainment"]
        slo = f"{att['predicted']:.2f}/{att['measured']:.2f}" if att["measured"] is not None else ""
        lines.append(f"{r['run'][:38]:38} {r['workload']:14} {' '.join(cells)} {slo:>10}  {ok}")
    lines.append(f"{f['runs_within_tolerance']} of {len(f['rows'])} runs within {f['tolerance_pct']:g}% on all four; "
                 f"configs with such a run: {', '.join(f['configs_within_tolerance']) or 'none'}")
    return "\n".join(lines)
