"""`pdcluster bench serve`: open-loop Poisson load on a cluster at one or more rates; latency, throughput, goodput.

Against a running cluster (`--addr`), one it starts from a deploy YAML (`--config`, in a child process), or any
OpenAI-compatible server (`--backend openai --base-url http://HOST:PORT/v1`: vLLM, SGLang, our HTTP front). For
each rate: a few warm-up requests, then the workload (same lengths at every rate, fresh token ids so no run
reuses another's prefix cache), then a wait until the cluster is idle. Prints a table (or `--json`), saves the
figures and every request's timings as JSON, and PNG plots next to it (latency CDFs, SLO attainment vs rate).
Definitions: pdcluster/bench/stats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from pdcluster.bench import markdown, plots, stats
from pdcluster.bench.report import emit, log, machine
from pdcluster.bench.runner import cluster_status
from pdcluster.bench.stats import ITL_STATS, RequestRecord
from pdcluster.bench.target import BACKENDS, Target
from pdcluster.bench.workloads import SHIFTS, WORKLOADS, Session, Workload, build

WARMUP_SALT = 10_000


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The options `bench serve` and `bench compare` share: workload, rates, SLOs, output."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    g.add_argument("--rates", default="0.5", help="request rates to sweep, req/s, comma separated (default 0.5)")
    g.add_argument("--num-requests", type=int, default=60, help="requests per rate (default 60)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-scale", type=float, default=1.0, help="stretch prompt lengths")
    g.add_argument("--output-scale", type=float, default=1.0, help="stretch answer lengths")
    g.add_argument("--think-scale", type=float, default=1.0,
                   help="stretch the users' pauses between turns (multi-turn workloads; 0: none)")
    g.add_argument("--warmup-requests", type=int, default=4, help="sent one by one before each rate, not counted")
    s = p.add_argument_group("SLOs (goodput = highest rate with >= 90%% of requests meeting both)")
    s.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    s.add_argument("--slo-itl-ms", type=float, default=150.0, help="per-request inter-token latency (--slo-itl-stat)")
    s.add_argument("--slo-itl-stat", choices=ITL_STATS, default="mean",
                   help="the request's figure held to --slo-itl-ms: its mean gap (TPOT) or its p90 gap")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="pdcluster",
                   help="pdcluster: our gRPC API (--addr, or a cluster started from --config); openai: any "
                        "OpenAI-compatible server at --base-url, over streamed /v1/completions")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--addr", help="a running cluster (gRPC HOST:PORT)")
    where.add_argument("--config", default=None, help="start this cluster for the run (default "
                                                      "deploy/bench-disagg.yaml)")
    where.add_argument("--base-url", default=None, help="with --backend openai: e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="with --backend openai: the model id to send (default: the first "
                                                 "of GET /v1/models)")
    p.add_argument("--routing", choices=["prefix_aware", "round_robin"], default=None,
                   help="override router.routing of --config")
    p.add_argument("--label", default=None, help="name of this run in tables and plots (default: the config)")
    add_workload_arguments(p)
    p.add_argument("--out", default="results/bench_serve.json")
    p.add_argument("--plot-with", action="append", default=[], metavar="JSON",
                   help="runs saved by another `bench serve` (e.g. the autoscaler off) drawn beside these on the "
                        "per-minute SLO attainment plot")


def rates_of(text: str, option: str = "--rates") -> list[float]:
    """The rates of a comma-separated option, or a ValueError naming it."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected numbers like 0.5,1,2, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"{option}: every rate must be > 0, got {text!r}")
    return rates


def slo_of(args: argparse.Namespace) -> stats.Slo:
    return stats.Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_itl_stat)


def sweep(target: Target, args: argparse.Namespace, label: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the workload at every rate of `args.rates` against `target`; one run object per rate."""
    slo = slo_of(args)
    runs = []
    for i, rate in enumerate(rates_of(args.rates)):
        _warm_up(target, args)
        w = build(args.workload, rate, args.num_requests, args.seed, input_scale=args.input_scale,
                  output_scale=args.output_scale, salt=i + 1, think_scale=args.think_scale)
        log("serve", f"{label}: {w.describe()}")
        records, elapsed = _with_progress(target, w, f"{label} @ {rate:g} req/s")
        target.wait_idle()
        summary = stats.summarize(records, elapsed, slo)
        runs.append({"label": label, "backend": target.backend, **meta,
                     "workload": {"name": w.name, "rate": rate, "num_requests": w.num_requests, **w.params},
                     "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_stat": slo.itl_stat},
                     "summary": summary, "requests": [r.as_dict() for r in records]})
        log("serve", f"{label} @ {rate:g} req/s: " + one_line(summary))
    return runs


def _with_progress(target: Target, w: Workload, desc: str) -> tuple[list[RequestRecord], float]:
    """Run `w` with a progress bar on stderr (requests done, failures so far)."""
    from tqdm import tqdm

    failed = 0
    with tqdm(total=w.num_requests, desc=desc, unit="req", dynamic_ncols=True) as bar:
        def done(r: RequestRecord) -> None:
            nonlocal failed
            failed += not r.ok
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)
        return target.run(w, done)


def _warm_up(target: Target, args: argparse.Namespace) -> None:
    """A few requests one at a time, so the first measured ones do not pay for cold caches and connections."""
    if args.warmup_requests <= 0:
        return
    w = build(args.workload, 1.0, args.warmup_requests, args.seed + 1, input_scale=args.input_scale,
              output_scale=args.output_scale, salt=WARMUP_SALT)
    for s in w.sessions:
        alone = Workload(w.name, w.rate, (Session(s.id, 0.0, s.turns[:1]),), w.params)
        records, _ = target.run(alone)
        if not records[0].ok:
            # NOTE: said at once: a server that cannot answer one request alone fails the whole run
            log("serve", f"warm-up request failed on {target.addr}: {records[0].error}")
    target.wait_idle()


def one_line(s: dict[str, Any]) -> str:
    return (f"{s['completed']} ok, {s['failed']} failed; TTFT p50 {s['ttft_ms']['p50']:.0f} / p99 "
            f"{s['ttft_ms']['p99']:.0f} ms; ITL p50 {s['itl_ms']['p50']:.0f} / p99 {s['itl_ms']['p99']:.0f} ms; "
            f"{s['output_tok_per_s']} tok/s; SLO attainment {100 * s['slo_attainment']:.0f}%")


def goodputs(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Goodput per label, from its runs' (rate, attainment) points."""
    by: dict[str, list[tuple[float, float]]] = {}
    several = len({r["workload"]["name"] for r in runs}) > 1  # NOTE: a rate sweep is per workload
    for r in runs:
        key = f"{r['label']}, {r['workload']['name']}" if several else r["label"]
        by.setdefault(key, []).append((r["workload"]["rate"], r["summary"]["slo_attainment"]))
    return {label: stats.goodput(pts) for label, pts in by.items()}


def format_table(f: dict[str, Any]) -> str:
    head = (f"{'run':<28} {'rate':>5} {'ok':>4} {'fail':>4} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} "
            f"{'p90':>6} {'p99':>7} {'E2E p50':>8} {'p99':>7} {'req/s':>6} {'tok/s':>6} {'hit':>5} {'xfer p50':>8} "
            f"{'SLO%':>5}")
    lines = [head]
    for r in f["runs"]:
        s = r["summary"]
        lines.append(
            f"{r['label']:<28} {r['workload']['rate']:>5g} {s['completed']:>4} {s['failed']:>4} "
            f"{s['ttft_ms']['p50']:>9.0f} {s['ttft_ms']['p90']:>7.0f} {s['ttft_ms']['p99']:>7.0f} "
            f"{s['itl_ms']['p50']:>8.0f} {s['itl_ms']['p90']:>6.0f} {s['itl_ms']['p99']:>7.0f} "
            f"{s['e2e_ms']['p50']:>8.0f} {s['e2e_ms']['p99']:>7.0f} {s['req_per_s']:>6.2f} "
            f"{s['output_tok_per_s']:>6.1f} {s['prefix_hit_rate']:>5.2f} {s['transfer_ms']['p50']:>8.1f} "
            f"{100 * s['slo_attainment']:>5.0f}")
        if len(s.get("slo_attainment_per_minute", [])) > 1:
            lines.append(f"  SLO attainment per minute: {format_minutes(s)}")
    for label, g in f.get("goodput", {}).items():
        lines.append(f"goodput {label}: {g['goodput_req_per_s']} req/s measured (estimate "
                     f"{g['goodput_estimate_req_per_s']}) at >= 90% of requests within TTFT {f['slo']['ttft_ms']:g} ms "
                     f"and ITL {f['slo']['itl_ms']:g} ms")
    if f.get("summary"):
        lines.append(f["summary"])
    for p in f.get("plots", []):
        lines.append(f"plot: {p}")
    return "\n".join(lines)


def finish(bench: str, runs: list[dict[str, Any]], args: argparse.Namespace, extra: dict[str, Any]) -> int:
    """Goodput, plots and the saved JSON of a set of runs."""
    figures: dict[str, Any] = {"bench": bench, "machine": machine(), **extra,
                               "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms,
                                       "itl_stat": args.slo_itl_stat},
                               "goodput": goodputs(runs), "runs": runs}
    if not args.no_plots:
        stem = os.path.splitext(args.out)[0]
        title = f"{args.workload} workload, {machine()['cores']} cores"
        figures["plots"] = [plots.latency_cdfs(runs, stem + "_cdf.png", title),
                            plots.attainment_vs_rate(runs, stem + "_slo.png", title)]
        beside = [r for path in getattr(args, "plot_with", []) for r in _saved_runs(path)]
        if any(len(r["summary"].get("slo_attainment_per_minute", [])) > 1 for r in runs):
            figures["plots"].append(plots.attainment_per_minute(runs + beside, stem + "_per_minute.png", title,
                                                                _shift_s(runs[0])))
    md = os.path.splitext(args.out)[0] + ".md"
    os.makedirs(os.path.dirname(os.path.abspath(md)), exist_ok=True)
    with open(md, "w") as f:
        f.write(markdown.render(figures))
    log(bench, f"saved {md}")
    return emit(bench, figures, args.out, args.json, format_table)


def _saved_runs(path: str) -> list[dict[str, Any]]:
    """The runs of a JSON `bench serve` saved (for --plot-with)."""
    import json

    try:
        with open(path) as f:
            return list(json.load(f)["runs"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--plot-with: cannot read runs from {path}: {e}") from None


def _shift_s(run: dict[str, Any]) -> float | None:
    """When a shifting workload's second half starts (the first request of it was sent), else None."""
    if run["workload"]["name"] not in SHIFTS:
        return None
    reqs = sorted(run["requests"], key=lambda r: r["session"])
    half = reqs[len(reqs) // 2:]
    return min(r["sent_s"] for r in half) if half else None


def format_minutes(s: dict[str, Any]) -> str:
    return " ".join(f"{100 * m['slo_attainment']:.0f}%" for m in s.get("slo_attainment_per_minute", []))


def check_workload_args(args: argparse.Namespace) -> None:
    """The workload options `bench serve` and `bench compare` share, as a ValueError naming the option."""
    rates_of(args.rates)
    if args.think_scale < 0:
        raise ValueError(f"--think-scale: must be >= 0, got {args.think_scale:g}")


def check_target_args(args: argparse.Namespace) -> None:
    """Which server options go with which backend, as a ValueError naming the option."""
    if args.backend == "openai":
        if not args.base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if args.routing:
            raise ValueError("--routing: only for a pdcluster cluster started from --config")
        from pdcluster.bench.openai_client import completions_url

        completions_url(args.base_url)  # NOTE: a malformed URL fails here, naming --base-url
        return
    for option, value in (("--base-url", args.base_url), ("--model", args.model)):
        if value:
            raise ValueError(f"{option}: only with --backend openai")
    stats.Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_itl_stat)


def run(args: argparse.Namespace) -> int:
    for path in args.plot_with:
        _saved_runs(path)  # NOTE: a bad file fails before the run, not after it
    check_workload_args(args)  # NOTE: bad input fails here, before a cluster is started for it
    check_target_args(args)
    if args.backend == "openai":
        target = Target("openai", args.base_url, args.model, args.api_key)
        runs = sweep(target, args, args.label or args.base_url, {"base_url": args.base_url})
        return finish("serve", runs, args, {})
    if args.addr:
        st = asyncio.run(cluster_status(args.addr, args.api_key))
        meta = {"addr": args.addr, "mode": st.mode}
        runs = sweep(Target("pdcluster", args.addr, api_key=args.api_key), args, args.label or args.addr, meta)
        return finish("serve", runs, args, {})
    from pdcluster.bench.cluster_proc import load, serving

    path = args.config or "deploy/bench-disagg.yaml"
    config = load(path, args.routing)
    label = args.label or f"{os.path.basename(path)} ({config.router.routing})"
    meta = {"config": path, "mode": config.mode, "routing": config.router.routing}
    with serving(config, label) as addr:
        runs = sweep(Target("pdcluster", addr, api_key=args.api_key), args, label, meta)
    return finish("serve", runs, args, {})
