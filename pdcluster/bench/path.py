"""`pdcluster bench path`: what the request path (router, Ray, handshake, relay) adds to the engine's own time.

For each model it runs, in one process and on the same prompts (fresh random token ids, greedy, `ignore_eos`):
1. the engine alone (bench/path_engine.py: the decode pool's engine settings, in this process, no cluster): the time
   to the first token of a prompt on an idle engine, the decode step at batch 1, and tokens/s of 1 and of N
   concurrent streams;
2. the same through a running cluster (`pdcluster serve` on `--config` in a child process, every request across
   the prefill -> decode handoff: prefix skipping and the SLO placement rules off), as a client sees it over OpenAI
   HTTP streaming and gRPC streaming: TTFT, the gaps between tokens (ITL p50), tokens/s. The engine alone runs
   each of these cases again, alternated with the cluster's on the same prompts (request by request, round by
   round, the N streams' first round just before the cluster's rounds): the TTFT added is the median of the pairs'
   differences, the 1-stream ratio the median of the rounds' ratios, the ITL added the difference of the two sides'
   p50s, so a slow spell of the shared machine between the two sides does not count as the path's;
3. where a first token's time goes: the router's own timeline of the TTFT requests (queue: arrival to the prefill's
   start on a worker; prefill: to its first token; first token: arrival to the token leaving the router), and the
   router process's CPU per request of them (all its threads' schedstat, net of its idle CPU): at GPU speed, how many
   requests one router process can take (the workers' threads over the same window, the engine alone's first
   tokens in it, idle);
4. the router process's CPU seconds per 1,000 relayed tokens over the N-stream run (`--stream-rounds` of it, each on
   fresh prompts; its threads' schedstat: the router,
   its Ray driver and everything else `serve` runs in that process), beside a bare server of the same front's
   library streaming as many tokens at the same pace (bench/path_floor.py): the part that is grpc.aio's or
   aiohttp's own per-message cost;
5. where one stream's time per token goes: the decode worker's own engine steps over the 1-stream runs (its
   `pdcluster_engine_step_seconds` summary), beside the engine alone's steps on the same prompts; what is
   left of the time per token is the path's (relay, the worker's loop, the client). The prefill worker's own step
   over the TTFT requests (one step each) sits beside their first tokens the same way.
The ratios (cluster / engine) are what carries over to a GPU: the path's own cost next to the engine's step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, get_args

from pdcluster.bench import cluster_proc
from pdcluster.bench.path_clients import (
    TIMELINE_PARTS,
    Timed,
    close_all,
    grpc_stream,
    http_stream,
    thread_ms,
    worker_steps,
    worker_threads,
)
from pdcluster.bench.path_engine import TTFT_TOKENS, Cases, EngineAlone, ms, summary
from pdcluster.bench.path_floor import floor, floor_per_request
from pdcluster.bench.path_table import format_table
from pdcluster.bench.report import emit, log, machine
from pdcluster.event_loop import resolve
from pdcluster.router_config import EventLoop

BENCH = "path"
BARE_REQUESTS = 40  # requests of TTFT_TOKENS the bare server answers one by one (its CPU per request)
IDLE_S = 3.0  # the router's idle CPU is measured over this long


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="deploy/local.yaml", help="the cluster's deploy YAML (its decode pool's "
                   "engine settings are the engine-alone baseline's)")
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated models to measure")
    p.add_argument("--fronts", default="http,grpc", help="comma-separated client fronts: http, grpc")
    p.add_argument("--prompt-len", type=int, default=75, help="prompt tokens of every request")
    p.add_argument("--ttft-requests", type=int, default=8, help="fresh prompts, one at a time, for TTFT")
    p.add_argument("--itl-tokens", type=int, default=64, help="tokens of the batch-1 stream whose gaps are ITL")
    p.add_argument("--itl-rounds", type=int, default=3, help="batch-1 streams of each side, alternated (ITL p50 is "
                   "over all their gaps)")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the throughput case")
    p.add_argument("--stream-tokens", type=int, default=256, help="tokens per stream in the throughput cases")
    p.add_argument("--stream-rounds", type=int, default=1, help="rounds of the many-streams case through the cluster, "
                   "each on fresh prompts (its tok/s and the router's CPU per 1,000 tokens are over all of them: more "
                   "rounds, less noise)")
    p.add_argument("--one-rounds", type=int, default=5, help="1-stream runs of each side, alternated (the median "
                   "is reported: one run of 256 tiny tokens lasts ~0.1-0.3 s)")
    p.add_argument("--stream-interval", type=int, default=None, help="the router's stream_interval (tokens per "
                   "streamed chunk); default: the config's")
    p.add_argument("--event-loop", choices=get_args(EventLoop), default=None,
                   help="the router's event_loop (the bare server runs on the same); default: the config's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_path.json")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    # NOTE: ids from the middle of the vocabulary: every prompt is new to every prefix cache (no block is shared)
    return [[rng.randrange(300, vocab - 1) for _ in range(length)] for _ in range(n)]


# ---- 2. through the cluster --------------------------------------------------------------------------------------
Stream = Callable[[str, list[int], int], Awaitable[Timed]]


async def through_cluster(stream: Stream, addr: str, prompts: Cases, args: argparse.Namespace,
                          pid: int, metrics: tuple[str, str], alone: EngineAlone,
                          more: Sequence[list[int]] = ()) -> dict[str, Any]:
    """The same cases as the engine alone's, as a client of `addr` sees them, each paired with `alone` on the same
    prompts just before (`metrics`: the prefill and the decode worker's /metrics URLs; `more`: the fresh prompts of
    the many-streams case's rounds after the first)."""
    try:
        return await _cases(stream, addr, prompts, args, pid, metrics, alone, more)
    finally:
        await close_all()


async def _cases(stream: Stream, addr: str, prompts: Cases, args: argparse.Namespace, pid: int,
                 metrics: tuple[str, str], alone: EngineAlone, more: Sequence[list[int]]) -> dict[str, Any]:
    await asyncio.gather(*(stream(addr, p, 4) for p in prompts.warm))
    ttft, parts, alone_ttft = [], [], []
    prefill0 = await asyncio.to_thread(worker_steps, metrics[0])
    threads0 = [await asyncio.to_thread(worker_threads, url) for url in metrics]
    router0, ttft_t0 = _cpu_ns(pid), time.perf_counter()
    for p in prompts.ttft:  # NOTE: each request right after the engine alone's first token of the same prompt
        alone_ttft.append(alone.ttft_s(p))  # NOTE: the bench's own process: the cluster idles meanwhile
        timed = await stream(addr, p, TTFT_TOKENS)
        ttft.append(timed.ttft_s)
        parts.append(timed.timeline)
        await asyncio.sleep(0.2)  # NOTE: idle between requests: the heartbeats show the workers idle again
    router_ttft_s, ttft_wall = (_cpu_ns(pid) - router0) / 1e9, time.perf_counter() - ttft_t0
    prefill1 = await asyncio.to_thread(worker_steps, metrics[0])
    threads1 = [await asyncio.to_thread(worker_threads, url) for url in metrics]
    alone_steps, itl = [], []
    for p in prompts.itl:  # NOTE: alternated, as the 1-stream rounds below
        alone_steps += alone.steps_s(p, args.itl_tokens)
        itl += (await stream(addr, p, args.itl_tokens)).gaps_s
    ones, alone_ones, steps0 = [], [], await asyncio.to_thread(worker_steps, metrics[1])
    for p in prompts.one:  # NOTE: alternated: each round's ratio is one pair's
        alone_ones.append(alone.stream_s(p, args.stream_tokens))
        t = time.perf_counter()
        ones.append((await stream(addr, p, args.stream_tokens), time.perf_counter() - t))
    steps1 = await asyncio.to_thread(worker_steps, metrics[1])
    alone_many = alone.run(prompts.many, args.stream_tokens)[2]  # NOTE: the N streams' first round, just before them
    # NOTE: the router's CPU at idle (heartbeat reads, pings, lease renewals) over a few seconds, taken out of the
    # run's figure for the net one: what relaying the tokens cost
    cpu0, t = _cpu_ns(pid) / 1e9, time.perf_counter()
    await asyncio.sleep(IDLE_S)
    idle_rate = (_cpu_ns(pid) / 1e9 - cpu0) / (time.perf_counter() - t)
    cpu0, t = _cpu_ns(pid) / 1e9, time.perf_counter()
    many = []
    for batch in [prompts.many, *(more[i:i + args.streams] for i in range(0, len(more), args.streams))]:
        many += await asyncio.gather(*(stream(addr, p, args.stream_tokens) for p in batch))
    many_s, cpu = time.perf_counter() - t, _cpu_ns(pid) / 1e9 - cpu0
    relayed = sum(r.tokens for r in many)
    bad = [r.tokens for r in [*(r for r, _ in ones), *many] if r.tokens != args.stream_tokens]
    if bad:
        log(BENCH, f"WARNING: {len(bad)} streams ended short of {args.stream_tokens} tokens: {bad[:4]}")
    # NOTE: the router's own timeline of the TTFT requests: where the first token's time went before it left the router
    timeline = {f"router_{k.removesuffix('_ms')}_ms_p50": round(statistics.median(t[k] for t in parts), 2)
                for k in TIMELINE_PARTS if all(k in t for t in parts)}
    engine = summary(alone_ttft, alone_steps, alone_ones, alone_many, len(prompts.many), args)
    itl_p50, tok_s_n = ms(statistics.median(itl)), relayed / many_s
    return {"ttft_ms_p50": ms(statistics.median(ttft)), **timeline, "itl_ms_p50": itl_p50,
            "tok_s_1": statistics.median(r.tokens / s for r, s in ones), f"tok_s_{args.streams}": tok_s_n,
            # NOTE: the engine alone's side of the pairs; the TTFT added and the 1-stream ratio as medians of the pairs'
            **{f"engine_{k}": v for k, v in engine.items()},
            "ttft_added_ms": ms(statistics.median(c - a for c, a in zip(ttft, alone_ttft, strict=True))),
            "itl_added_ms": round(itl_p50 - engine["step_ms_p50"], 2),
            f"ratio_{args.streams}": round(tok_s_n / engine[f"tok_s_{args.streams}"], 3),
            "ratio_1": round(statistics.median(r.tokens / s / (args.stream_tokens / a) for (r, s), (a, _)
                                               in zip(ones, alone_ones, strict=True)), 3),
            "worker_step_ms_mean_1": ms((steps1[1] - steps0[1]) / max(1, steps1[0] - steps0[0])),
            # NOTE: one step per TTFT request there (a prompt within the step budget): its prefill, as the worker ran it
            "prefill_worker_step_ms_mean": ms((prefill1[1] - prefill0[1]) / max(1, prefill1[0] - prefill0[0])),
            # NOTE: where each worker's CPU went over those requests (a hand-off each), by thread: ms per request
            "threads_ms_per_request": {role: thread_ms(threads0[i], threads1[i], args.ttft_requests)
                                       for i, role in enumerate(("prefill", "decode"))},
            # NOTE: the router's CPU for one request of the TTFT case (8 tokens), all its threads, net of its idle
            "router_cpu_ms_per_request": ms(router_ttft_s / args.ttft_requests),
            "router_cpu_ms_per_request_net": ms(max(0.0, router_ttft_s - idle_rate * ttft_wall) / args.ttft_requests),
            "router_cpu_s_per_1k_tokens": cpu / max(relayed, 1) * 1e3,
            "router_cpu_s_per_1k_tokens_net": max(0.0, cpu - idle_rate * many_s) / max(relayed, 1) * 1e3,
            "router_idle_cpu": idle_rate}


def _cpu_ns(pid: int) -> int:
    """CPU nanoseconds of process `pid`'s live threads so far (their schedstat: finer than /proc/PID/stat's ticks,
    which a few ms of CPU per request would fall between); the router's threads live as long as it does."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # NOTE: a thread that ended meanwhile
    return total


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: the engine alone, then each front through a cluster of it."""
    from engine.loader import load_model

    loaded = load_model(model)
    vocab = loaded.config.vocab_size
    n = Cases.count(args)
    fronts = [f for f in args.fronts.split(",") if f]
    rng = random.Random(args.seed)
    prompts = {f: Cases.of(_prompts(rng, n, args.prompt_len, vocab), args) for f in ["engine", *fronts]}
    more = {f: _prompts(rng, args.streams * (args.stream_rounds - 1), args.prompt_len, vocab) for f in fronts}
    log(BENCH, f"{model}: the engine alone")
    alone = EngineAlone(loaded, args.config)
    result: dict[str, Any] = {"engine": alone.figures(prompts["engine"], args)}
    cfg = cluster_proc.load(args.config, http="http" in fronts)
    cfg.model = model
    cfg.router.skip_prefill_max_uncached_tokens = 0  # NOTE: every request crosses the handoff
    cfg.router.slo_itl_ms = None
    cfg.router.stream_interval, cfg.router.event_loop = args.stream_interval, args.event_loop
    # NOTE: worker i of the cluster (pools in order: prefill, then decode) serves its /metrics on base + i
    cfg.metrics.workers, cfg.metrics.worker_host = True, "127.0.0.1"
    cfg.metrics.worker_port = base = cluster_proc.free_port(cfg.prefill.replicas + cfg.decode.replicas)
    metrics = (f"http://127.0.0.1:{base}/metrics", f"http://127.0.0.1:{base + cfg.prefill.replicas}/metrics")
    with cluster_proc.serving_endpoints(cfg, f"path-{model}") as ep:
        result["cluster"] = {"start_s": float(ep["start_s"])}  # launch to `serve`'s ready line
        for front in fronts:
            log(BENCH, f"{model}: through the cluster over {front}")
            addr, stream = (ep["http"], http_stream) if front == "http" else (ep["grpc"], grpc_stream)
            result[front] = asyncio.run(through_cluster(stream, addr, prompts[front], args, int(ep["pid"]),
                                                        metrics, alone, more[front]))
    streams = {"http": http_stream, "grpc": grpc_stream}
    for front in fronts:  # NOTE: the bare library's CPU per token at the pace the cluster's N streams ran
        r = result[front]
        log(BENCH, f"{model}: a bare {front} server at the same pace")
        r["bare_cpu_s_per_1k_tokens"] = floor(front, streams[front], args.streams, args.stream_tokens,
                                              gap_s=args.streams / r[f"tok_s_{args.streams}"],
                                              every=args.stream_interval, loop=args.event_loop)
        r["bare_cpu_ms_per_request"] = round(floor_per_request(
            front, streams[front], max(BARE_REQUESTS, args.ttft_requests), TTFT_TOKENS, loop=args.event_loop), 2)
    return result


def run(args: argparse.Namespace) -> int:
    models = [m for m in args.models.split(",") if m]
    for flag in ("stream_rounds", "ttft_requests", "itl_rounds", "one_rounds"):  # NOTE: each is a median's sample
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    router = cluster_proc.load(args.config).router
    if args.stream_interval is None:  # NOTE: the config's, so the bare server's floor writes the same messages
        args.stream_interval = router.stream_interval
    if args.event_loop is None:  # NOTE: the config's, so the bare server runs on the same loop
        args.event_loop = router.event_loop
    figures: dict[str, Any] = {"bench": BENCH, "machine": machine(), "config": args.config, "streams": args.streams,
                               "stream_rounds": args.stream_rounds,
                               "prompt_len": args.prompt_len, "stream_tokens": args.stream_tokens,
                               "stream_interval": args.stream_interval, "event_loop": resolve(args.event_loop),
                               "models": {}}
    for model in models:
        figures["models"][model] = measure(model, args)
    return emit(BENCH, figures, args.out, args.json, format_table)
