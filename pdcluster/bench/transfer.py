"""`pdcluster bench transfer`: KV transport throughput next to memcpy and raw TCP, and layer-wise overlap.

One run, one machine. The payload is the real KV of one prefilled prompt (SmolLM2-135M, 2048 tokens: ~94 MB fp32).
1. References: numpy memcpy of a payload-sized array; raw TCP on loopback to another process (`sendall` of a
   memoryview, `recv_into` a preallocated buffer, timed until the receiver acks the last byte); cma: the
   payload written into another process's buffer with `process_vm_writev` (Linux), the copy UCX's cma transport
   makes for `nixl` on one host, without checks: the most a checked `nixl` send can reach here.
2. Transports: each timed send is open_sender → prepare → send_layer of every layer (read during the payload's
   prefill) → commit → wait until DONE, from this process to a receiver engine in a spawned process (grpc, torch)
   or in this one (local). GB/s = payload bytes ÷ seconds; best and median of --repeat after --warmup. Each
   receiver checks the CRC of the KV it ends up holding. CPU s/GB: CPU time (all threads) each end's process
   spent per GB moved, medians: unlike GB/s it barely moves when other work shares the machine's cores, and it
   says which end limits the transport.
3. Overlap (grpc, torch): a 1-thread prefill engine times a fresh prompt's prefill alone (T_p), prefill then
   read + send (T_seq), and prefill with layers sent as they are computed (T_lw, as a prefill worker does).
   T_x = T_seq − T_p, overlap = (T_seq − T_lw) ÷ T_x: the fraction of the transfer hidden behind prefill. When
   T_x is smaller than the run-to-run spread of the prefill itself, that difference of differences is noise;
   "hidden" compares what is left after the prefill in the same runs (tail: end of prefill to DONE),
   1 − tail_lw ÷ tail_seq.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from kv_transfer.state import TRANSPORTS, TransferConfig
from pdcluster.bench.report import emit, log, machine
from pdcluster.bench.transfer_peers import BenchError, LocalPeer, Peer, kv_receiver
from pdcluster.bench.transfer_refs import cma_figures, figures, idle_core_pct, memcpy_figures, tcp_figures
from pdcluster.bench.transfer_sender import DEADLINE_S, PrefillSender

DEFAULT_OUT = "results/bench_transfer.json"
# fraction of raw TCP (the transfer issues)
TARGETS = {"grpc": 0.60, "torch": 0.80, "nixl": 1.5, "nixl-tcp": 0.8, "nixl-scatter": 0.6}
REFERENCE_OF = {"grpc": "tcp", "torch": "tcp", "local": "memcpy", "nixl": "tcp", "nixl-tcp": "tcp",
                "nixl-scatter": "tcp"}
# NOTE: "nixl-tcp" is nixl with UCX_TLS=tcp (as between hosts), run by a child bench process: UCX reads its
# environment once per process, and both ends must use the same transports
CHOICES = (*TRANSPORTS, "nixl-tcp", "nixl-scatter")  # nixl-scatter: 30 layers x 32 scattered 64 KiB blocks
IDLE_S = 3.0  # default of --idle-s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny', a .gguf file or a Hugging Face directory")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens whose KV is the payload")
    p.add_argument("--repeat", type=int, default=3, help="timed sends per transport (best and median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed sends per transport first")
    p.add_argument("--overlap-repeat", type=int, default=2, help="layer-wise overlap rounds per transport (0: skip)")
    p.add_argument("--transports", default=",".join(CHOICES), help=f"comma-separated subset of {','.join(CHOICES)}")
    p.add_argument("--grpc-streams", type=int, default=TransferConfig.grpc_streams, help="grpc: parallel Push streams")
    p.add_argument("--chunk-bytes", type=int, default=TransferConfig.chunk_bytes, help="grpc: bytes per chunk")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="both ends' KV cache: the model's dtype, or int8 blocks with per-block-per-head scales")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="both ends' engines as TP groups of N ranks (the KV read from and written into every rank's "
                        "pool; CPU s/GB then counts rank 0's process only)")
    p.add_argument("--receiver-tensor-parallel-size", type=int, default=None, metavar="M",
                   help="the receiving engine as a TP group of M ranks instead (nixl then gathers the heads a "
                        "receiver rank holds otherwise than any sender rank; default: --tensor-parallel-size)")
    p.add_argument("--idle-s", type=float, default=IDLE_S, help="seconds each receiver process is watched idle, "
                   "its transport up (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--out", default=DEFAULT_OUT, help="where to save the JSON figures")


def _log(msg: str) -> None:
    log("transfer", msg)


def _child_nixl_tcp(args: argparse.Namespace, refs: dict[str, Any]) -> dict[str, Any]:
    """nixl over UCX's TCP transport: this bench's nixl row from a child process run with UCX_TLS=tcp."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/nixl-tcp.json"
        cmd = [sys.executable, "-m", "pdcluster", "bench", "transfer", "--transports", "nixl", "--model", args.model,
               "--tokens", str(args.tokens), "--repeat", str(args.repeat), "--warmup", str(args.warmup),
               "--overlap-repeat", "0", "--kv-cache-dtype", args.kv_cache_dtype, "--idle-s", str(args.idle_s),
               "--tensor-parallel-size", str(args.tensor_parallel_size), "--out", out,
               "--receiver-tensor-parallel-size", str(args.receiver_tensor_parallel_size or args.tensor_parallel_size)]
        done = subprocess.run(cmd, env={**os.environ, "UCX_TLS": "tcp"}, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise BenchError(f"nixl-tcp: the child bench failed (exit {done.returncode})")
        with open(out) as f:
            row: dict[str, Any] = json.load(f)["transports"]["nixl"]
    row |= {"reference": "tcp", "ratio": row["best_gb_s"] / refs["tcp"]["best_gb_s"], "target": TARGETS["nixl-tcp"]}
    row["target_met"] = row["ratio"] >= row["target"]
    return row


def _scatter(args: argparse.Namespace, refs: dict[str, Any]) -> dict[str, Any]:
    """The scattered-blocks case (transfer_scatter.py) against raw TCP (per byte: its payload differs)."""
    from pdcluster.bench import transfer_scatter as sc

    peer = Peer("nixl-scatter", sc.scatter_sink)
    try:
        info = peer.address  # NOTE: the sink sends its agent and pool where other peers send an address
        runs = sc.scatter_round(peer.conn, info, args.warmup + args.repeat)[args.warmup :]  # type: ignore[arg-type]
    finally:
        peer.close()
    row = figures(runs, sc.nbytes())
    row |= {"reference": "tcp", "ratio": row["best_gb_s"] / refs["tcp"]["best_gb_s"], "target": TARGETS["nixl-scatter"]}
    row["target_met"] = row["ratio"] >= row["target"]
    return row


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from engine import EngineConfig
    from engine.loader import load_model

    t_start = time.perf_counter()
    # NOTE: a receiver that goes away makes gRPC log GOAWAY at info level on the channels this process keeps
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    if bad := [t for t in names if t not in CHOICES]:
        raise BenchError(f"--transports: unknown {', '.join(bad)}; choose from {', '.join(CHOICES)}")
    transports = [t for n in names for t in CHOICES if t == n]
    if args.tokens < 1 or args.repeat < 1 or args.warmup < 0 or args.overlap_repeat < 0:
        raise BenchError("--tokens and --repeat must be >= 1, --warmup and --overlap-repeat >= 0")
    torch.set_num_threads(1)
    _log(f"loading {args.model}")
    loaded = load_model(args.model)
    cfg = loaded.config
    n_blocks = -(-args.tokens // EngineConfig().block_size)
    num_blocks, max_batched = 2 * n_blocks + 8, max(2048, args.tokens)
    tp = args.tensor_parallel_size
    rtp = args.receiver_tensor_parallel_size or tp
    sender = PrefillSender(loaded, args.tokens, num_blocks, args.kv_cache_dtype, tp)
    _log(f"prefill of the {args.tokens}-token payload prompt")
    t0 = time.perf_counter()
    payload = sender.payload()
    payload_prefill_s = time.perf_counter() - t0
    nbytes = payload.nbytes
    _log(f"payload {nbytes / 1e6:.1f} MB; memcpy and raw TCP references")
    refs = {"memcpy": memcpy_figures(nbytes, max(5, args.repeat)), "tcp": tcp_figures(nbytes, args.warmup, args.repeat)}
    if cma := cma_figures(nbytes, args.warmup, args.repeat):
        refs["cma"] = cma
    results: dict[str, dict[str, Any]] = {}
    overlap: dict[str, dict[str, Any]] = {}
    for name in transports:
        if name == "nixl-scatter":
            _log("nixl-scatter: 30 layers x 32 scattered 64 KiB blocks")
            results[name] = _scatter(args, refs)
            continue
        if name == "nixl-tcp":
            _log("nixl-tcp: a child bench with UCX_TLS=tcp")
            results[name] = _child_nixl_tcp(args, refs)
            continue
        _log(f"{name}: starting the receiver")
        peer: LocalPeer | Peer = (
            LocalPeer(loaded, num_blocks, max_batched, args.kv_cache_dtype, rtp) if name == "local"
            else Peer(name, kv_receiver, name, args.model, num_blocks, max_batched, args.kv_cache_dtype, rtp,
                      daemon=rtp == 1))
        try:
            tc = TransferConfig(transport=name, deadline_s=DEADLINE_S,  # type: ignore[arg-type]
                                grpc_streams=args.grpc_streams, chunk_bytes=args.chunk_bytes)
            _log(f"{name}: {args.warmup} + {args.repeat} sends of the payload")
            runs = [sender.send(tc, peer, payload) for _ in range(args.warmup + args.repeat)][args.warmup :]
            row = figures([r.seconds for r in runs], nbytes, runs)
            ref = REFERENCE_OF[name]
            row |= {"reference": ref, "ratio": row["best_gb_s"] / refs[ref]["best_gb_s"],
                    "target": TARGETS.get(name)}
            row["target_met"] = row["ratio"] >= row["target"] if row["target"] is not None else None
            results[name] = row
            if name != "local" and args.overlap_repeat:
                _log(f"{name}: layer-wise overlap, {args.overlap_repeat} round(s) of 3 prefills")
                overlap[name] = sender.overlap(tc, peer, args.overlap_repeat)
            if peer.pid is not None and args.idle_s > 0:
                row["idle_core_pct"] = idle_core_pct(peer.pid, args.idle_s)
        finally:
            peer.close()
    return {
        "model": cfg.name, "model_id": cfg.model_id, "dtype": sender.engine.kv_layout.dtype,
        "machine": machine(),
        "payload": {"tokens": args.tokens, "bytes": nbytes, "num_blocks": n_blocks, "num_layers": cfg.num_layers,
                    "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                    "block_size": sender.engine.config.block_size, "prefill_s": payload_prefill_s},
        "workload": {"repeat": args.repeat, "warmup": args.warmup, "overlap_repeat": args.overlap_repeat,
                     "prefill_threads": 1, "deadline_s": DEADLINE_S, "grpc_streams": args.grpc_streams,
                     "chunk_bytes": args.chunk_bytes, "idle_s": args.idle_s, "tensor_parallel_size": tp,
                     "receiver_tensor_parallel_size": rtp},
        "references": refs, "transports": results, "overlap": overlap,
        "runtime_s": time.perf_counter() - t_start,
    }


def format_table(r: dict[str, Any]) -> str:
    p, w = r["payload"], r["workload"]
    lines = [f"KV payload: {r['model']} ({r['model_id']}), {p['tokens']} tokens = {p['num_blocks']} blocks x "
             f"{p['num_layers']} layers, {r['dtype']}: {p['bytes'] / 1e6:.1f} MB; best/median of {w['repeat']} "
             f"after {w['warmup']} warm-up; {r['machine']['cores']} cores, torch {r['machine']['torch']}"
             + _tp(w),
             f"grpc: {w['grpc_streams']} streams, {w['chunk_bytes'] / 2**20:g} MiB chunks; CPU s/GB: CPU time of the "
             "sending / receiving process per GB (local: both in one process); idle %core: the receiver process's CPU "
             f"over {r['workload']['idle_s']:g} s with nothing sent; nixl-tcp: nixl with UCX_TLS=tcp (a child bench)",
             f"{'':13}{'best GB/s':>10}{'median GB/s':>13}{'CPU s/GB':>10}{'':>6}{'ratio':>8}  {'of':<7}{'target':>8}"
             f"  met{'idle %core':>12}"]
    for name, row in [*r["references"].items(), *r["transports"].items()]:
        cpu = "/".join(f"{row[k]:.2f}" if row.get(k) is not None else "-"
                       for k in ("sender_cpu_s_per_gb", "receiver_cpu_s_per_gb"))
        line = f"{name:13}{row['best_gb_s']:10.2f}{row['median_gb_s']:13.2f}{cpu:>16}"
        if "ratio" in row:
            line += f"{row['ratio']:8.2f}  {row['reference']:<7}"
            line += (f"{'>= ' + format(row['target'], '.2f'):>8}  {'yes' if row['target_met'] else 'NO ':3}"
                     if row["target"] is not None else f"{'':13}")
            if row.get("idle_core_pct") is not None:
                line += f"{row['idle_core_pct']:12.2f}"
        lines.append(line)
    cma, nixl = r["references"].get("cma"), r["transports"].get("nixl")
    if cma and nixl:
        lines.append(f"nixl best = {nixl['best_gb_s'] / cma['best_gb_s']:.2f} of cma's (the same copy without "
                     f"checks); cma = {cma['best_gb_s'] / r['references']['tcp']['best_gb_s']:.2f} of raw TCP")
    if r["overlap"]:
        lines += ["", f"layer-wise overlap: 1-thread prefill of {p['tokens']} tokens, medians of "
                      f"{w['overlap_repeat']} round(s); tail = end of prefill to DONE; spread = max - min of the "
                      "prefills run without sending",
                  f"{'':8}{'T_p s':>7}{'T_seq s':>9}{'T_lw s':>8}{'T_x s':>8}{'overlap':>9}{'spread s':>10}"
                  f"{'tail seq s':>12}{'tail lw s':>11}{'hidden':>8}"]
        noisy = []
        for name, o in r["overlap"].items():
            ov = f"{o['overlap']:9.0%}" if o["overlap"] is not None else f"{'-':>9}"
            lines.append(f"{name:8}{o['prefill_s']:7.2f}{o['sequential_s']:9.2f}{o['layerwise_s']:8.2f}"
                         f"{o['transfer_s']:8.3f}{ov}{o['prefill_spread_s']:10.3f}{o['sequential_tail_s']:12.3f}"
                         f"{o['layerwise_tail_s']:11.3f}{o['tail_hidden']:8.0%}")
            if o["prefill_spread_s"] > abs(o["transfer_s"]):
                noisy.append(name)
        lines.append("overlap = (T_seq - T_lw) / T_x, T_x = T_seq - T_p; hidden = 1 - tail lw / tail seq")
        if noisy:
            lines.append(f"NOTE {', '.join(noisy)}: prefill time varies between runs by more than T_x, so overlap "
                         "is within noise; hidden compares the tails of the same runs and is not")
    lines.append(f"[{r['runtime_s']:.0f} s]")
    return "\n".join(lines)


def _tp(w: dict[str, Any]) -> str:
    """The header's TP part: both ends' size, or the sender's then the receiver's."""
    tp, rtp = w.get("tensor_parallel_size", 1), w.get("receiver_tensor_parallel_size", w.get("tensor_parallel_size", 1))
    if tp != rtp:
        return f"; sender TP {tp}, receiver TP {rtp}"
    return f"; both ends TP {tp}" if tp > 1 else ""


def run(args: argparse.Namespace) -> int:
    try:
        r = measure(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return emit("transfer", r, args.out, args.json, format_table)
