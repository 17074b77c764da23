"""`pdcluster bench soak`: N concurrent streams for T minutes; count what was lost, repeated or leaked.

Every request asks for an exact number of tokens (`ignore_eos`), so a stream that ends with fewer tokens lost some
and one with more repeated some. At the end the cluster must be idle: each worker's free KV blocks back to its
total (anything else leaked), and the workers' resident memory is compared with the start (after a warm-up).
Against a running cluster (`--addr`) or one it starts itself from a deploy YAML (`--config`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from collections import Counter
from typing import Any

import grpc

from pdcluster.bench import soak_faults
from pdcluster.bench.cluster_proc import free_port
from pdcluster.bench.report import emit, log
from pdcluster.bench.soak_faults import Faults
from router.v1 import inference_pb2 as pb

TOPICS = ["the history of bicycles", "how tides work", "a recipe for bread", "the rules of chess", "why leaves fall",
          "how a compiler works", "the life of bees", "a trip to the mountains"]
SYSTEM = "You are a helpful assistant. Answer clearly, with examples, in plain language. " * 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--addr", help="a running `pdcluster serve` (gRPC HOST:PORT)")
    where.add_argument("--config", default="deploy/local.yaml", help="start this cluster for the soak")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to keep them going")
    p.add_argument("--warmup-s", type=float, default=30.0, help="memory is measured from the end of the warm-up")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--out", default="results/bench_soak.json")
    soak_faults.add_arguments(p)


class _Tally:
    """What every stream saw, added up under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = self.expected = self.received = self.lost = self.repeated = 0
        self.failed: Counter[str] = Counter()
        self.ttft_ms: list[float] = []
        self.served: list[tuple[float, str]] = []  # (start, decode worker that finished it) per request


def _stream(stub: Any, rng: random.Random, args: argparse.Namespace, end: float, tally: _Tally) -> None:
    while time.monotonic() < end:
        n = rng.randint(args.min_tokens, args.max_tokens)
        shared = rng.random() < 0.5  # half share a long system prompt (prefix cache traffic)
        prompt = (SYSTEM if shared else "") + f"Tell me about {rng.choice(TOPICS)} (#{rng.randrange(10**6)})."
        req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=n, temperature=0,
                                                                           ignore_eos=True))
        got, last, started = 0, None, time.monotonic()
        try:
            for chunk in stub.GenerateStream(req, timeout=300):
                got += len(chunk.token_ids)
                last = chunk
        except grpc.RpcError as e:
            with tally.lock:
                tally.failed[e.code().name] += 1  # type: ignore[attr-defined]
            continue
        with tally.lock:
            tally.done += 1
            tally.expected += n
            tally.received += got
            tally.lost += max(0, n - got)
            tally.repeated += max(0, got - n)
            if last is not None and last.usage.completion_tokens != got:
                tally.repeated += abs(last.usage.completion_tokens - got)
            if last is not None:
                tally.ttft_ms.append(last.timeline.first_token_ms)
                tally.served.append((started, last.timeline.decode_worker))


def soak(addr: str, args: argparse.Namespace, faults: Faults | None = None) -> dict[str, Any]:
    """Run the soak against the cluster at `addr` (with `faults` mid-way); the figures."""
    from pdcluster.client import stub as make_stub

    stub = make_stub(addr, args.api_key)
    tally = _Tally()
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    threads = [threading.Thread(target=_stream, args=(stub, random.Random(args.seed + i), args, end, tally),
                                daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    if faults is not None:
        faults.start(t0)
    warm = min(args.warmup_s, args.minutes * 30)
    time.sleep(warm)
    start = {w.name: w.rss_bytes for w in stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30).workers}
    while any(t.is_alive() for t in threads):
        time.sleep(min(30.0, max(0.5, end - time.monotonic())))
        with tally.lock:
            log("soak", f"{(time.monotonic() - t0) / 60:.1f} min: {tally.done} done, {sum(tally.failed.values())} "
                        f"failed, {tally.lost} tokens lost, {tally.repeated} repeated")
    elapsed = time.monotonic() - t0
    if faults is not None:
        faults.stop()
    status = _wait_idle(stub)
    workers = {w.name: {"kv_blocks_leaked": w.num_blocks - w.free_blocks if w.alive else 0, "alive": w.alive,
                        "running_at_end": w.running,
                        "rss_start_mb": round(start.get(w.name, 0) / 2**20, 1),
                        "rss_end_mb": round(w.rss_bytes / 2**20, 1),
                        "rss_growth_mb": round((w.rss_bytes - start.get(w.name, 0)) / 2**20, 1)}
               for w in status.workers}
    ttft = sorted(tally.ttft_ms) or [0.0]
    return {"bench": "soak", "addr": addr, "streams": args.streams, "minutes": round(elapsed / 60, 2),
            "requests_done": tally.done, "requests_failed": sum(tally.failed.values()),
            "failed_by_status": dict(tally.failed), "tokens_expected": tally.expected,
            "tokens_received": tally.received, "tokens_lost": tally.lost, "tokens_duplicated": tally.repeated,
            "kv_blocks_leaked": sum(w["kv_blocks_leaked"] for w in workers.values()),
            "tokens_per_s": round(tally.received / elapsed, 1), "requests_per_s": round(tally.done / elapsed, 3),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p99_ms": round(ttft[int(0.99 * (len(ttft) - 1))], 1),
            "prefix_hit_rate": round(status.prefix_hit_rate, 3), "workers": workers,
            **(faults.figures(tally.served) if faults is not None else {})}


def _wait_idle(stub: Any, timeout: float = 60.0) -> pb.ClusterStatus:
    """The cluster status once every worker is idle with all blocks free (or the last seen at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        st = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
        # NOTE: a worker killed for good (--kill-at) has no heartbeat: it holds nothing and is not waited for
        idle = all(w.running == 0 and w.free_blocks == w.num_blocks for w in st.workers if w.alive)
        if idle or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def format_table(f: dict[str, Any]) -> str:
    lines = [f"soak: {f['streams']} streams for {f['minutes']} min against {f['addr']}",
             f"  requests done {f['requests_done']}, failed {f['requests_failed']} {f['failed_by_status'] or ''}",
             f"  tokens expected {f['tokens_expected']}, received {f['tokens_received']}, lost {f['tokens_lost']}, "
             f"duplicated {f['tokens_duplicated']}",
             f"  KV blocks leaked {f['kv_blocks_leaked']}; {f['tokens_per_s']} tok/s, {f['requests_per_s']} req/s, "
             f"TTFT p50 {f['ttft_p50_ms']} ms / p99 {f['ttft_p99_ms']} ms, prefix hit rate {f['prefix_hit_rate']}"]
    for fault in f.get("faults", []):
        lines.append(f"  fault: {fault['kind']} {fault['worker']} at {fault['at_min']} min")
    if "faults" in f:
        lines.append(f"  after the heartbeat TTL: {f['requests_on_faulted_worker_after_ttl']} requests on a faulted "
                     f"worker; decode failovers {f['decode_failovers']} in all, "
                     f"{f['decode_failovers_after_settle']} after the faulted workers' streams had moved")
    for name, w in f["workers"].items():
        if not w.get("alive", True):
            lines.append(f"  {name:<12} dead (killed for good); RSS at the start {w['rss_start_mb']} MB")
            continue
        lines.append(f"  {name:<12} leaked {w['kv_blocks_leaked']} blocks, RSS {w['rss_start_mb']} → "
                     f"{w['rss_end_mb']} MB ({w['rss_growth_mb']:+} MB)")
    return "\n".join(lines)



def run(args: argparse.Namespace) -> int:
    if args.addr:
        if args.kill_at is not None or args.hang_at is not None:
            raise SystemExit("bench soak: --kill-at/--hang-at need the cluster the soak starts (--config)")
        figures = soak(args.addr, args)
    else:
        import asyncio
        import pathlib

        from cluster import logs
        from pdcluster.config import ClusterConfig
        from pdcluster.serve import run as serve

        path = pathlib.Path(args.config)
        if not path.exists():
            path = pathlib.Path(__file__).resolve().parent.parent.parent / path
        config = ClusterConfig.from_yaml(path)
        config.router.port = config.http.port = config.metrics.port = 0
        config.router.max_inflight = max(config.router.max_inflight, args.streams * 2)
        if args.decode_replicas:
            config.decode.replicas = args.decode_replicas
            need = sum(p.ray_resources()["CPU"] * p.replicas for p in config.pools().values())  # every rank
            if config.ray.address == "local" and (config.ray.num_cpus or os.cpu_count() or 1) < need:
                config.ray.num_cpus = need  # NOTE: logical CPUs: the workers share the cores, as the soak intends
        config.metrics.enabled, config.metrics.port = True, free_port()
        logs.configure("router", "WARNING", config.logging.format)
        result: dict[str, Any] = {}
        faults = Faults(args, config.ray.namespace, f"http://127.0.0.1:{config.metrics.port}/metrics",
                        config.router.stall_timeout_min_s)

        async def body(addr: str) -> None:
            result.update(await asyncio.to_thread(soak, addr, args, faults if faults.planned else None))
        serve(config, body)
        figures = result
    return emit("soak", figures, args.out, args.json, format_table)
