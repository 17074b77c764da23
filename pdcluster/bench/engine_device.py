"""`pdcluster bench engine --device cuda`: our engine against transformers' generate on one device, same weights,
one process, and both against the device's own limits measured in the same run.

Figures (best of --repeats; definitions as in pdcluster/bench/engine.py):
- decode tok/s at each of --device-batches (default 1 and 64) after --context prompt tokens (512): ours (with CUDA
  graphs on CUDA), at batch 1 ours with graphs one step at a time (`decode_lookahead` off) and eager, transformers;
  ratio = ours / transformers;
- prefill tok/s of one --prefill-tokens prompt (2,048): ours and transformers;
- the HBM bound of batch-1 decode: bytes read per step (every weight but the embedding table, plus the KV of the
  context) ÷ the device-to-device copy bandwidth measured here (bytes read + written per second), as tok/s; ours
  as a share of it;
- the matmul peak: a big torch.mm in the engine's dtype (bf16 on CUDA), TFLOP/s measured here; prefill as a share
  of it (FLOPs: 2 x matmul weights x tokens + causal attention).
With --device cpu and tiny settings it runs anywhere (the CI smoke test); only the CUDA figures mean anything.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch

from pdcluster.bench.engine_timing import OursTimer, ReferenceTimer, best, sync
from pdcluster.bench.report import emit, log, machine

DEFAULT_OUT = "results/bench_engine_device.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="'cuda', 'cuda:N' or 'cpu': the device bench (this module's "
                                                  "figures) instead of the CPU engine bench")
    p.add_argument("--dtype", default="auto", help="--device: weights' and KV dtype (auto: bf16 on CUDA)")
    p.add_argument("--device-batches", default="1,64", help="--device: decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="--device: prompt tokens before decoding")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="--device: prompt tokens of the prefill figure")


def _timed(device: torch.device, fn: Any, repeats: int) -> float:
    """Best wall time of `fn()` over `repeats` runs (after one warm-up), the device synchronized around each."""
    fn()
    fastest = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        fastest = min(fastest, time.perf_counter() - t)
    return fastest


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = _timed(device, lambda: y.copy_(x), 5)
    return 2 * x.numel() * 4 / t


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n torch.mm in `dtype` on random data."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _timed(device, lambda: torch.mm(a, b), 5)
    return 2 * n**3 / t


def _measure_ours(ours: OursTimer, name: str, batches: list[int], prefill: bool, args: argparse.Namespace,
                  prompts: Any, figures: dict[str, Any]) -> None:
    ctx, n_dec, n_pre = args.context, args.decode_tokens, args.prefill_tokens
    ours.run(prompts(2, 32), 4)  # warm-up
    for b in batches:
        log("engine", f"ours ({name}): decode batch {b}, {n_dec} tokens after {ctx}")
        first, total = best(args.repeats, lambda b=b: ours.run(prompts(b, ctx), n_dec))
        tok_s = figures["decode"].setdefault(str(b), {})[f"ours_{name}_tok_s"] = b * (n_dec - 1) / (total - first)
        log("engine", f"  {tok_s:.1f} tok/s")  # NOTE: each figure in the log as it comes (a run cut short keeps it)
    if prefill:
        log("engine", f"ours: prefill {n_pre} tokens")
        # NOTE: one untimed prefill of this length first: a first one pays one-time costs of its shapes (cuBLAS's
        # and SDPA's choices, allocator growth), about twice the next ones' time on an H200 (BENCHMARKS.md)
        ours.run(prompts(1, n_pre), 1)
        (first,) = best(args.repeats, lambda: (ours.run(prompts(1, n_pre), 1)[0],))
        figures["prefill"][str(n_pre)] = {"ours_tok_s": n_pre / first}
        log("engine", f"  {n_pre / first:.1f} tok/s")


def measure_device(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the module docstring, as one dict."""
    from engine.config import resolve_device, resolve_dtype
    from engine.loader import load_model
    from engine.pool_size import kv_bytes_per_block

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    batches = [int(b) for b in args.device_batches.split(",")]
    ctx, n_dec, n_pre, bs = args.context, args.decode_tokens, args.prefill_tokens, 16
    log("engine", f"loading {args.model} on {device} in {dtype_name}")
    loaded = load_model(args.model, device=device, dtype=dtype)
    cfg = loaded.config
    gen = torch.Generator().manual_seed(0)

    def prompts(b: int, n: int) -> list[list[int]]:
        return torch.randint(100, min(cfg.vocab_size, 49152), (b, n), generator=gen).tolist()

    num_blocks = max(batches) * -(-(ctx + n_dec) // bs) + -(-(n_pre + 1) // bs) + 16
    budget = max(n_pre + 1, 2048)
    figures: dict[str, Any] = {"decode": {}, "prefill": {}}
    # NOTE: on CUDA also batch 1 with graphs one step at a time (no lookahead: engine/step.py Lookahead), and eager
    engines: dict[str, dict[str, bool]] = {"eager": {"enforce_eager": True}}
    if device.type == "cuda":
        engines = {"graphs": {}, "stepwise": {"decode_lookahead": False}, **engines}
    main = list(engines)[0]
    for name, overrides in engines.items():
        ours = OursTimer(loaded, device=str(device), dtype=dtype_name, num_blocks=num_blocks,
                         max_num_seqs=max(batches), max_num_batched_tokens=budget, **overrides)
        figures.setdefault("cuda_graphs", ours.engine.runner.graphs is not None and name == "graphs")
        _measure_ours(ours, name, batches if name == main else [1], name == main, args, prompts, figures)
        del ours
        gc.collect()  # NOTE: the runner and its graphs refer to each other: only the collector frees them
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_reference:
        ref = ReferenceTimer(loaded, device)
        ref.run(prompts(2, 32), 4)
        for b in batches:
            log("engine", f"transformers: decode batch {b}")
            p = prompts(b, ctx)
            t_all, t_one = best(args.repeats, lambda p=p: (ref.run(p, n_dec), ref.run(p, 1)))
            row = figures["decode"][str(b)]
            row["transformers_tok_s"] = b * (n_dec - 1) / (t_all - t_one)
            row["ratio"] = row[f"ours_{main}_tok_s"] / row["transformers_tok_s"]
            log("engine", f"  {row['transformers_tok_s']:.1f} tok/s (ours {row['ratio']:.2f}x)")
        log("engine", f"transformers: prefill {n_pre}")
        ref.run(prompts(1, n_pre), 1)  # NOTE: untimed, as ours
        (t_pre,) = best(args.repeats, lambda: (ref.run(prompts(1, n_pre), 1),))
        row = figures["prefill"][str(n_pre)]
        row["transformers_tok_s"] = n_pre / t_pre
        row["ratio"] = row["ours_tok_s"] / row["transformers_tok_s"]
        log("engine", f"  {row['transformers_tok_s']:.1f} tok/s (ours {row['ratio']:.2f}x)")
        del ref
    # limits measured here
    cuda = device.type == "cuda"
    bw = copy_bandwidth(device, 2048 if cuda else 256)
    peak = matmul_peak(device, dtype, 8192 if cuda else 1024)
    weights = {k: w for k, w in loaded.weights.items() if k != "model.embed_tokens.weight" or cfg.tie_word_embeddings}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    kv_bytes = ctx * kv_bytes_per_block(cfg, bs, dtype) // bs
    bound_tok_s = bw / (weight_bytes + kv_bytes)
    matmul_params = sum(w.numel() for k, w in weights.items() if k.endswith("proj.weight") or k == "lm_head.weight"
                        or (k == "model.embed_tokens.weight" and cfg.tie_word_embeddings))
    attn_flops = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n_pre * n_pre  # QK^T and PV, causal half
    prefill_flops = 2 * matmul_params * n_pre + attn_flops
    ours_b1 = figures["decode"].get("1", {}).get(f"ours_{main}_tok_s")
    t_prefill = n_pre / figures["prefill"][str(n_pre)]["ours_tok_s"]
    figures["limits"] = {
        "copy_bandwidth_gb_s": bw / 1e9, "weight_bytes": weight_bytes, "kv_bytes_at_context": kv_bytes,
        "decode_bound_tok_s_batch1": bound_tok_s,
        "decode_batch1_share_of_bound": ours_b1 / bound_tok_s if ours_b1 else None,
        "decode_batch1_stepwise_share_of_bound": (figures["decode"]["1"]["ours_stepwise_tok_s"] / bound_tok_s
                                                  if "ours_stepwise_tok_s" in figures["decode"].get("1", {}) else None),
        "matmul_peak_tflop_s": peak / 1e12, "prefill_tflop_s": prefill_flops / t_prefill / 1e12,
        "prefill_share_of_peak": prefill_flops / t_prefill / peak}
    name = torch.cuda.get_device_name(device) if cuda else machine()["cpu"]
    return {"model": cfg.name, "model_id": cfg.model_id, "device": str(device), "device_name": name,
            "dtype": dtype_name, "machine": machine(),
            "workload": {"context": ctx, "decode_tokens": n_dec, "prefill_tokens": n_pre, "batches": batches,
                         "repeats": args.repeats}, **figures}


def format_device(r: dict[str, Any]) -> str:
    """The device bench's figures as a table."""
    lines = [f"model {r['model']} on {r['device']} ({r['device_name']}), {r['dtype']}, CUDA graphs "
             f"{'on' if r['cuda_graphs'] else 'off'}, torch {r['machine']['torch']}",
             f"{'':8}{'batch':>6}{'ours tok/s':>13}{'stepwise':>10}{'eager':>10}{'transformers':>14}{'ratio':>8}"]
    for b, row in r["decode"].items():
        ours = row.get("ours_graphs_tok_s", row.get("ours_eager_tok_s", 0.0))
        others = "".join(f"{row[k]:10.1f}" if k in row else f"{'':10}"
                         for k in ("ours_stepwise_tok_s", "ours_eager_tok_s"))
        ref = f"{row['transformers_tok_s']:14.1f}{row['ratio']:7.2f}x" if "ratio" in row else ""
        lines.append(f"{'decode':8}{b:>6}{ours:13.1f}{others}{ref}")
    for n, row in r["prefill"].items():
        ref = f"{'':20}{row['transformers_tok_s']:14.1f}{row['ratio']:7.2f}x" if "ratio" in row else ""
        lines.append(f"{'prefill':8}{n:>6}{row['ours_tok_s']:13.1f}{ref}")
    lim = r["limits"]
    share = lim["decode_batch1_share_of_bound"]
    lines.append(f"copy bandwidth {lim['copy_bandwidth_gb_s']:.0f} GB/s, {lim['weight_bytes'] / 1e9:.2f} GB weights + "
                 f"{lim['kv_bytes_at_context'] / 1e6:.1f} MB KV -> batch-1 decode bound "
                 f"{lim['decode_bound_tok_s_batch1']:.1f} tok/s" + (f"; ours {share:.0%} of it" if share else "")
                 + (f" (one step at a time {lim['decode_batch1_stepwise_share_of_bound']:.0%})"
                    if lim.get("decode_batch1_stepwise_share_of_bound") else ""))
    lines.append(f"matmul peak {lim['matmul_peak_tflop_s']:.1f} TFLOP/s; prefill {lim['prefill_tflop_s']:.1f} "
                 f"TFLOP/s = {lim['prefill_share_of_peak']:.0%} of it")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdcluster.bench.engine_device --device cuda ...`: the device bench without the CLI's imports (a GPU
    node without Ray, pydantic or redis: scripts/gpu-check.sh). The flags are `pdcluster bench engine`'s."""
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.engine_device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per sequence when decoding")
    p.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is kept")
    p.add_argument("--no-reference", action="store_true", help="skip transformers (ours only)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--out", default=DEFAULT_OUT, help="where to save the JSON figures")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.device is None:
        p.error("--device is required here ('cuda', 'cuda:N' or 'cpu')")
    return emit("engine", measure_device(args), args.out, args.json, format_device)


if __name__ == "__main__":
    sys.exit(main())
