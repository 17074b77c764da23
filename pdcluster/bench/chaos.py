"""`pdcluster bench chaos`: mixed gRPC and HTTP traffic for N minutes while actors, Redis and a router are killed.

1. start `pdcluster serve --config` as a child process (any free ports, the OpenAI front and metrics on) and one
   extra `pdcluster router` attached to it (`--ray`/`--redis` from serve's ready line), on fixed free ports so a
   restart takes the same ones;
2. `--clients` threads send fresh prompts (gRPC or HTTP, streamed or unary, to either router), each with a deadline;
3. the faults of `chaos_faults.schedule` run on their own thread (kills, a freeze, a client that stops reading);
   the routers' resident memory is sampled every 2 s;
4. when the traffic stops, the cluster has a minute to go idle; its workers' blocks and the routers' in-flight
   counts are read, serve is stopped, and one in-process engine computes the reference of every finished request
   (`chaos_reference`: greedy, up to near ties);
5. `chaos_check.check` prints each invariant as PASS/FAIL, with the fault events and per-window outcome counts;
   the figures are saved as JSON (`--out`). The exit code is 0 either way: the invariants are the result.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import asdict
from typing import Any

from pdcluster.bench import chaos_faults, chaos_reference, chaos_traffic
from pdcluster.bench.chaos_check import FinalState, Invariant, Record, Reference, check, windows, wrong_text
from pdcluster.bench.chaos_router import ExtraRouter, inflight, metric, wait_idle
from pdcluster.bench.report import emit, log


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="deploy/local.yaml", help="the cluster to start (`pdcluster serve --config`)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--deadline-s", type=float, default=60.0, help="every request's deadline")
    p.add_argument("--min-prompt", type=int, default=16, help="prompt length in tokens, at least")
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=8, help="exact output length, at least (ignore_eos)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--freeze-s", type=float, default=15.0, help="how long the frozen worker stays stopped")
    p.add_argument("--stall-s", type=float, default=120.0, help="how long the stalled client reads nothing at most "
                   "(it reads again once the router counts a client stall)")
    p.add_argument("--max-restarts", type=int, default=3, help="each pool's max_restarts at least this")
    p.add_argument("--rss-limit-mb", type=float, default=256.0, help="a router's allowed resident memory growth")
    p.add_argument("--window-s", type=float, default=15.0, help="width of the outcome-count windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--out", default="results/bench_chaos.json")


def run(args: argparse.Namespace) -> int:
    from pdcluster.bench.cluster_proc import load, serving_endpoints

    if args.minutes <= 0 or args.clients < 1 or args.min_tokens > args.max_tokens or args.min_prompt > args.max_prompt:
        raise SystemExit("bench chaos: --minutes > 0, --clients >= 1, --min-* <= --max-* please")
    config = load(args.config, http=True)
    config.metrics.enabled, config.metrics.port = True, 0
    for pool in config.pools().values():
        pool.max_restarts = -1 if pool.max_restarts < 0 else max(pool.max_restarts, args.max_restarts)
    config.router.max_inflight = max(config.router.max_inflight, args.clients * 4)
    with serving_endpoints(config, "chaos") as ep:
        extra = ExtraRouter(config, ep)
        try:
            records, events, rss, stalled = _traffic(args, ep, extra, config.served_model_name)
            final = _final_state(ep, extra)
        finally:
            extra.stop()
    reference, llm = chaos_reference.compute(config.model, records)
    ties = {} if llm is None else chaos_reference.near_ties(
        llm, [r for r in records if r.status == "OK" and wrong_text(r, reference)], reference)
    figures = _figures(args, records, events, rss, stalled, final, reference, ties)
    return emit("chaos", figures, args.out, args.json, format_table)


def _traffic(args: argparse.Namespace, ep: dict[str, str], extra: ExtraRouter, model: str
             ) -> tuple[list[Record], list[chaos_faults.Event], dict[str, list[float]], list[str]]:
    from pdcluster.client import stub as make_stub

    stubs = {"serve": make_stub(ep["grpc"], None), "extra": make_stub(extra.grpc, None)}
    http = {"serve": ep["http"], "extra": extra.http}
    records: list[Record] = []
    lock, stop = threading.Lock(), threading.Event()
    t0 = time.monotonic()
    end = t0 + args.minutes * 60

    def client(k: int) -> None:
        rng = random.Random(args.seed * 1000 + k)
        while time.monotonic() < end:
            with lock:
                r = chaos_traffic.new_record(len(records), rng, time.monotonic() - t0, args)
                records.append(r)
            if r.proto == "grpc":
                chaos_traffic.send_grpc(stubs[r.router], r, args.deadline_s)
            else:
                chaos_traffic.send_http(http[r.router], model, r, args.deadline_s)
            r.end_s = time.monotonic() - t0
            if r.status != "OK":
                time.sleep(0.5)  # NOTE: a client backs off a little after a failure, as real ones do

    rss: dict[str, list[float]] = {}
    stalled: list[str] = []

    def sample() -> None:
        while not stop.wait(2.0):
            for name, pid in (("serve", int(ep["pid"])), (f"extra#{extra.starts}", extra.ready_pid)):
                mb = extra.rss_mb(pid)
                if mb is not None:
                    rss.setdefault(name, []).append(mb)

    def stall() -> str:
        def stalls() -> float:  # the router's count of clients it cut off for not reading
            return metric(ep.get("metrics"), "pdcluster_client_stalls_total") or 0.0
        counted = stalls()
        t = threading.Thread(target=lambda: stalled.append(chaos_traffic.stalled_stream(
            http["serve"], model, 2000, args.stall_s, lambda: stalls() > counted)), daemon=True)
        t.start()
        return f"reads its first bytes, then nothing until cut off (at most {args.stall_s:.0f} s; outcome below)"

    faults = chaos_faults.FaultRunner(chaos_faults.schedule(args.minutes), int(ep["pid"]), extra.restart, stall,
                                      args.freeze_s)
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for t in threads:
        t.start()
    faults.start(t0)
    while any(t.is_alive() for t in threads[:-1]):
        time.sleep(min(30.0, max(1.0, end - time.monotonic())))
        with lock:
            done = sum(r.status == "OK" for r in records)
        log("chaos", f"{(time.monotonic() - t0) / 60:.1f} min: {len(records)} requests, {done} finished")
    faults.stop()
    stop.set()
    deadline = time.monotonic() + args.stall_s + 40
    while not stalled and time.monotonic() < deadline and any(e.kind == "stall-client" for e in faults.events):
        time.sleep(1.0)
    return records, faults.events, rss, stalled


def _final_state(ep: dict[str, str], extra: ExtraRouter) -> FinalState:
    from pdcluster.client import stub as make_stub

    status = wait_idle(make_stub(ep["grpc"], None))
    workers = [{"name": w.name, "alive": w.alive, "running": w.running, "free_blocks": w.free_blocks,
                "num_blocks": w.num_blocks} for w in (status.workers if status is not None else [])]
    return FinalState(workers, {"serve": inflight(ep.get("metrics")), "extra": inflight(extra.metrics)})


def _figures(args: argparse.Namespace, records: list[Record], events: list[chaos_faults.Event],
             rss: dict[str, list[float]], stalled: list[str], final: FinalState,
             reference: Reference, ties: dict[int, str]) -> dict[str, Any]:
    kills = tuple(e.at_s for e in events if e.kind == "kill-router")
    invariants = check(records, reference, final, rss, args.rss_limit_mb, kills, ties)
    for e in events:
        if e.kind == "stall-client":
            e.outcome += "; " + (stalled[0] if stalled else "no outcome (the stalled client did not finish)")
            # NOTE: the client that stopped reading is cut off (its slot and blocks freed), not served or held open
            invariants.append(Invariant("client_stall", bool(stalled) and stalled[0].startswith("cut off"),
                                        stalled[0] if stalled else "the stalled client did not finish"))
    return {"bench": "chaos", "config": args.config, "minutes": args.minutes, "clients": args.clients,
            "requests": len(records), "finished": sum(r.status == "OK" for r in records),
            "invariants": [asdict(i) for i in invariants],
            "all_passed": all(i.passed for i in invariants),
            "faults": [asdict(e) for e in events],
            "windows": windows(records, args.window_s),
            "router_rss_mb": {k: {"first": v[0], "max": max(v), "last": v[-1]} for k, v in rss.items() if v},
            "final": asdict(final),
            "failures": [{"index": r.index, "at_s": round(r.start_s, 1), "proto": r.proto, "streamed": r.streamed,
                          "router": r.router, "status": r.status, "detail": r.detail}
                         for r in records if r.status != "OK"][:200]}


def format_table(f: dict[str, Any]) -> str:
    lines = [f"chaos: {f['requests']} requests ({f['finished']} finished) from {f['clients']} clients over "
             f"{f['minutes']} min against {f['config']}", "", "fault events:"]
    lines += [f"  {e['at_s']:7.1f} s  {e['kind']:<14} {e['target']:<32} {e['outcome']}" for e in f["faults"]]
    statuses = sorted({k for w in f["windows"] for k in w if k != "from_s"})
    lines += ["", "outcomes per window (by request start):",
              "  " + f"{'from':>7}  " + "  ".join(f"{s:>18}" for s in statuses)]
    lines += ["  " + f"{w['from_s']:>6}s  " + "  ".join(f"{w.get(s, 0):>18}" for s in statuses) for w in f["windows"]]
    lines += ["", "invariants:"]
    lines += [f"  {'PASS' if i['passed'] else 'FAIL'}  {i['name']:<14} {i['detail']}" for i in f["invariants"]]
    return "\n".join(lines)
