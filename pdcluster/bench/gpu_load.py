"""The load parts of gpu-check's cluster step (pdcluster/bench/gpu_cluster.py): (b) the KV handoff of long prompts,
(c) `bench serve`'s sweep, disaggregated and colocated, with the engine's own step times beside it, (d) the sweep
under CUDA MPS.

SLOs (stated by issue 38): TTFT <= 500 ms, ITL (the request's mean gap, TPOT) <= 50 ms; goodput is `bench serve`'s:
the highest rate at which >= 90% of requests meet both. Sweeps: `random-1k` is the summarization workload scaled to
~1,000 prompt tokens and ~128 output tokens (random ids, exact lengths), `chat` the sharegpt mix with answers halved
(~170 tokens). `idle` is a few requests one at a time before each sweep: the router's own timeline of a lone request
(first token; decode time per token), set beside the engine's prefill and batch-1 decode step measured in this
process after the clusters stop.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

from pdcluster.bench import cluster_proc, serve
from pdcluster.bench.gpu_node import NeedsCuda, engine_of, fresh_prompts, generate, one_node, save
from pdcluster.bench.target import Target

SLO_TTFT_MS, SLO_ITL_MS = 500.0, 50.0
SWEEPS = {"random-1k": ("summarization", 1000 / 1200, 128 / 80), "chat": ("sharegpt", 1.0, 0.5)}
IDLE_REQUESTS = 4
# NOTE: the private Ray of `serve` keeps its session under RAY_TMPDIR (default /tmp); each worker's stdout there
RAY_WORKER_LOGS = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_latest", "logs", "worker-*")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load parts (handoff, serve, mps)")
    g.add_argument("--model", default="random:llama-3.1-8b")
    # NOTE: sized so both modes' clusters, sweeps and the engine alone fit the part's 240 s on an H200
    g.add_argument("--rates", default="4,12,24", help="req/s of each sweep")
    g.add_argument("--num-requests", type=int, default=24, help="requests per rate")
    g.add_argument("--modes", default="disaggregated,colocated")
    g.add_argument("--workloads", default=",".join(SWEEPS), help=f"of {','.join(SWEEPS)}")
    g.add_argument("--input-scale", type=float, default=1.0, help="stretch every sweep's prompts (the CPU: < 1)")
    g.add_argument("--output-scale", type=float, default=1.0, help="stretch every sweep's answers")
    g.add_argument("--handoff-tokens", type=int, default=2048)
    g.add_argument("--handoff-prompts", type=int, default=6, help="the first pays the pair's first use: not counted")
    g.add_argument("--mps-percent", type=int, default=50, help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of each worker")


def _idle(addr: str, args: argparse.Namespace, prompt_len: int) -> dict[str, Any]:
    """Lone requests, one at a time (batch 1 everywhere): the router's timeline of each, medians."""
    prompts = fresh_prompts(IDLE_REQUESTS + 1, args.seed + 7, args.vocab, prompt_len, prompt_len)
    got = asyncio.run(generate(addr, prompts, 32))[1:]  # NOTE: the first pays cold caches
    return {"prompt_len": prompt_len, "ttft_ms_p50": statistics.median(g["first_token_ms"] for g in got),
            "prefill_ms_p50": statistics.median(g["prefill_ms"] for g in got),
            "itl_ms_p50": statistics.median(g["decode_ms"] / 31 for g in got)}


def _sweep(args: argparse.Namespace, mode: str, env_vars: dict[str, str] | None = None,
           workloads: list[str] | None = None, label: str = "") -> dict[str, Any]:
    """Start the cluster of `mode`; idle figures, then each sweep; summaries and goodput (saved as they come)."""
    cfg = one_node(args.device, args.model, mode=mode, env_vars=env_vars)
    label = label or mode
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"mode": mode, "config": cfg.model_dump(mode="json", include={"prefill", "decode",
                                                                                          "colocated", "transfer"})}
    with cluster_proc.serving(cfg, label) as addr:
        out["idle"] = _idle(addr, args, round(1000 * args.input_scale))
        target = Target("pdcluster", addr)
        for name in workloads or args.workloads.split(","):
            workload, in_s, out_s = SWEEPS[name]
            ns = argparse.Namespace(rates=args.rates, workload=workload, num_requests=args.num_requests, seed=0,
                                    input_scale=in_s * args.input_scale, output_scale=out_s * args.output_scale,
                                    think_scale=1.0, warmup_requests=2, slo_ttft_ms=SLO_TTFT_MS, slo_itl_ms=SLO_ITL_MS,
                                    slo_itl_stat="mean")
            runs += serve.sweep(target, ns, f"{label} {name}", {"mode": mode, "sweep": name})
            out["runs"] = [{k: v for k, v in r.items() if k != "requests"} for r in runs]
            out["goodput"] = serve.goodputs(runs)
            save(args.out_dir, f"serve_{label}.partial", out)
    return out


def engine_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone in this process: prefill of a ~1,000-token prompt, decode step at batch 1 (best of 3)."""
    from engine.sampling_params import SamplingParams

    llm = engine_of(args.model, args.device, "auto")
    n = round(1000 * args.input_scale)
    prompts = iter(fresh_prompts(8, args.seed + 11, args.vocab, n, n))  # NOTE: fresh each time: no prefix hit

    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate([next(prompts)], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return (time.perf_counter() - t0) * 1e3

    timed(2)  # warm-up
    prefill = min(timed(1) for _ in range(3))
    decode = min(timed(33) for _ in range(3))
    return {"prompt_len": n, "prefill_ms": round(prefill, 2), "decode_step_ms_b1": round((decode - prefill) / 32, 3)}


def _beside(modes: dict[str, Any], eng: dict[str, Any]) -> dict[str, Any]:
    """Issue 38's idle targets: TTFT <= the engine's prefill + 10 ms, ITL p50 <= its decode step + 1 ms."""
    return {m: {"ttft_over_engine_prefill_ms": round(r["idle"]["ttft_ms_p50"] - eng["prefill_ms"], 2),
                "itl_over_engine_step_ms": round(r["idle"]["itl_ms_p50"] - eng["decode_step_ms_b1"], 3),
                "ttft_within_10ms": r["idle"]["ttft_ms_p50"] <= eng["prefill_ms"] + 10,
                "itl_within_1ms": r["idle"]["itl_ms_p50"] <= eng["decode_step_ms_b1"] + 1}
            for m, r in modes.items()}


def part_serve(args: argparse.Namespace) -> dict[str, Any]:
    """(c): each mode's sweep on its own cluster, then the engine alone."""
    modes = {m: _sweep(args, m) for m in args.modes.split(",") if m}
    eng = engine_figures(args)
    served = sum(r["summary"]["completed"] for m in modes.values() for r in m["runs"])
    failed = sum(r["summary"]["failed"] for m in modes.values() for r in m["runs"])
    return {"ok": served > 0 and failed == 0, "model": args.model, "slo": {"ttft_ms": SLO_TTFT_MS,
            "itl_ms": SLO_ITL_MS, "itl_stat": "mean"}, "served": served, "failed": failed, "modes": modes,
            "engine": eng, "idle_vs_engine": _beside(modes, eng)}


def _worker_lines(pattern: str, needle: str) -> list[str]:
    """The distinct lines holding `needle` in the files `pattern` matches (from `needle` on, at most 12)."""
    found = set()
    for path in sorted(glob.glob(pattern)):
        with open(path, errors="replace") as f:
            found |= {line[line.index(needle):].strip()[:240] for line in f if needle in line}
    return sorted(found)[:12]


def _ucx_lanes(pattern: str) -> list[str]:
    """The UCX endpoint configurations the workers logged (`nixl_agent.ucx_lanes`).

    NOTE: UCX_LOG_FILE gave empty files on the H200 (NIXL's UCX build, 2026-11-30): UCX_LOG_LEVEL=info alone
    prints them on each worker's stdout, which Ray keeps in the session's worker-*.out files (`pattern`)."""
    from kv_transfer.transports.nixl_agent import ucx_lanes

    return ucx_lanes(_worker_lines(pattern, "INFO"))


def _copy_gb_s(nbytes: int) -> float:
    """A device-to-device copy of `nbytes` on this process's GPU: bytes copied per second (best of 5), GB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def part_handoff(args: argparse.Namespace) -> dict[str, Any]:
    """(b): long prompts through the cluster, one at a time; the handoff's bytes and tail, the copy beside it."""
    cfg = one_node(args.device, args.model, env_vars={"UCX_LOG_LEVEL": "info"})
    n = args.handoff_tokens
    with cluster_proc.serving(cfg, "handoff") as addr:
        got = asyncio.run(generate(addr, fresh_prompts(args.handoff_prompts, args.seed + 3, args.vocab, n, n), 2))
    timed = got[1:]
    nbytes = int(statistics.median(g["kv_bytes_sent"] for g in timed))
    tail = statistics.median(g["transfer_ms"] for g in timed)
    prefill = statistics.median(g["prefill_ms"] for g in timed)
    copy = _copy_gb_s(nbytes)
    return {"ok": nbytes > 0 and all(not g["prefill_skipped"] for g in got), "model": args.model, "tokens": n,
            "kv_bytes": nbytes, "prefill_ms_p50": prefill, "tail_ms_p50": tail, "copy_gb_s": round(copy, 1),
            # NOTE: the handoff overlaps the prefill layer by layer; what a user waits for is the tail. Whole
            # transfer GB/s between the two processes: gpu_kv's nixl test (pytest_gpu_kv.xml, nixl_gb_s)
            "copy_ms_of_same_bytes": round(nbytes / copy / 1e6, 3), "ucx_lanes": _ucx_lanes(RAY_WORKER_LOGS),
            # NOTE: whether the direct lane (CUDA IPC, kv_transfer/transports/cuda_ipc.py) carried them, or why not
            "kv_lane": _worker_lines(RAY_WORKER_LOGS, "nixl-cuda-ipc:"),
            "requests": [{k: v for k, v in g.items() if k != "token_ids"} for g in got]}


def _mps(cmd: str, env: dict[str, str]) -> str:
    return subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", env=env, capture_output=True, text=True,
                          timeout=20).stdout.strip()


def part_mps(args: argparse.Namespace) -> dict[str, Any]:
    """(d): the disaggregated random-1k sweep with an MPS daemon splitting the GPU's SMs between the workers."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise NeedsCuda("mps: needs CUDA MPS (nvidia-cuda-mps-control is not on PATH)")
    base = os.path.join(os.path.abspath(args.out_dir), "mps")
    os.makedirs(os.path.join(base, "log"), exist_ok=True)
    # NOTE: the serve child and its Ray workers inherit these, so their CUDA contexts join this daemon
    os.environ.update(CUDA_MPS_PIPE_DIRECTORY=os.path.join(base, "pipe"),
                      CUDA_MPS_LOG_DIRECTORY=os.path.join(base, "log"))
    env = dict(os.environ)
    start = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=20)
    if start.returncode != 0:
        raise NeedsCuda(f"mps: the daemon did not start (rc {start.returncode}): {start.stderr.strip()[-300:]}")
    try:
        pct = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(args.mps_percent)}
        result = _sweep(args, "disaggregated", env_vars=pct, workloads=["random-1k"], label="mps")
        servers = _mps("get_server_list", env)
    finally:
        _mps("quit", env)
    log_tail = ""
    control = os.path.join(base, "log", "control.log")
    if os.path.exists(control):
        with open(control, errors="replace") as f:
            log_tail = f.read()[-1500:]
    return {"ok": bool(servers) and all(r["summary"]["failed"] == 0 for r in result["runs"]), "mps_servers": servers,
            "active_thread_percentage": args.mps_percent, "control_log_tail": log_tail, **result}
