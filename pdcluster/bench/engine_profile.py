"""`python -m pdcluster.bench.engine_profile`: where a decode step's time goes (issue 26).

1. host (any machine): the host time of laying out a decode-only step for a CUDA graph, before the replay can start:
   the metadata builder (`AttentionMetadata.build(..., out=static)`, tensor ops and a pack) against the graphs' staging
   (engine/cuda_graphs.py: numpy views of a host twin of the static buffers), at batch 1 and 64 (contexts of 520
   tokens, block tables 600 wide); and the builder for an eager step of 64 decode rows and one 256-token chunk.
2. `--device cuda` also: batch-1 decode of `--model` (random:llama-3.1-8b) after a 512-token prompt, with CUDA
   graphs: `engine.step()` (median of 60 steps) with the lookahead (engine/model_runner.py) and one step at a time,
   the graph's replay alone (50 back to back: the GPU's time), the logits and argmax alone; the host's share of a
   step one at a time is that step less the other two. Then the kernels of 5 replays by GPU time and the CPU time
   of `cudaGraphLaunch` (torch profiler).
Prints a table and saves --out (results/bench_engine_profile.json). scripts/gpu-check.sh runs it as its last step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.bench.report import emit, log

DEFAULT_OUT = "results/bench_engine_profile.json"
BLOCK, SPARE, WIDTH, CONTEXT = 16, 600, 600, 520


def _us(fn: Callable[[], object], n: int) -> float:
    """Mean microseconds of fn() over n calls (after one)."""
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def host_layout(n: int = 300) -> dict[str, float]:
    """Section 1 of the module docstring, in microseconds (CPU tensors: the host's work only), means of n calls."""
    from engine.attention import AttentionMetadata
    from engine.cuda_graphs import GraphBucket

    out: dict[str, float] = {}
    for rows in (1, 64):
        static = AttentionMetadata.build([[SPARE]] * rows, [0] * rows, [1] * rows, BLOCK, device="cpu",
                                         backend="triton", pad_blocks=WIDTH, pad_block=SPARE)
        g = GraphBucket(rows, torch.zeros(2, rows, dtype=torch.long), static, cuda=False)
        tables = [list(range(i * 40, i * 40 + CONTEXT // BLOCK + 1)) for i in range(rows)]
        starts, ids = [CONTEXT] * rows, [5] * rows

        def builder(tables: list[list[int]] = tables, starts: list[int] = starts, ids: list[int] = ids,
                    rows: int = rows, static: Any = static) -> None:
            AttentionMetadata.build(tables, starts, [1] * rows, BLOCK, device="cpu", backend="triton",
                                    pad_rows=rows, pad_blocks=WIDTH, pad_block=SPARE, out=static)
            torch.tensor([ids, starts], dtype=torch.long)

        def staging(g: Any = g, tables: list[list[int]] = tables, starts: list[int] = starts,
                    ids: list[int] = ids) -> None:
            g.stage(ids, starts, tables, starts, BLOCK, SPARE)
            g.upload()

        out[f"graph_builder_b{rows}_us"] = _us(builder, n)
        out[f"graph_staging_b{rows}_us"] = _us(staging, n)
    tables = [list(range(i * 40, i * 40 + 33)) for i in range(64)] + [list(range(5000, 5040))]
    out["eager_builder_64_rows_and_a_chunk_us"] = _us(lambda: AttentionMetadata.build(
        tables, [CONTEXT] * 64 + [384], [1] * 64 + [256], BLOCK, device="cpu", backend="triton"), n)
    return out


def _table(prof: Any, rows: int = 14) -> str:
    for key in ("self_device_time_total", "self_cuda_time_total"):  # NOTE: the name changed across torch versions
        try:
            return str(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))
        except (AttributeError, KeyError, RuntimeError):
            continue
    return ""


def device_step(model: str, device: str) -> dict[str, Any]:
    """Section 2 of the module docstring (milliseconds), and the profiler's kernel table as text."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import load_model

    dev = torch.device(device)
    loaded = load_model(model, device=dev, dtype="auto")
    engine = LLMEngine(loaded, EngineConfig(device=device, num_blocks=600, max_num_seqs=8,
                                            max_num_batched_tokens=2048, enable_prefix_caching=False))
    runner = engine.runner
    if runner.graphs is None or 1 not in runner.graphs.graphs:
        raise RuntimeError("no batch-1 CUDA graph (enforce_eager, or not the triton backend)")
    prompt = torch.randint(100, 49152, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("profile", prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()

    def step_times(n: int = 60) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    times = step_times()  # NOTE: as configured (the lookahead on: engine/step.py Lookahead)
    won = runner.lookahead_won
    engine.config.decode_lookahead = False
    engine.step()  # NOTE: the lookahead launched by the last step is taken here
    stepwise = step_times()
    engine.config.decode_lookahead = True
    g = runner.graphs.graphs[1]
    assert g.graph is not None and g.hidden is not None
    hidden = g.hidden

    def timed(fn: Callable[[], object], n: int = 50) -> float:
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / n * 1e3

    replay_ms = timed(g.graph.replay)
    logits_ms = timed(lambda: runner.model.logits(hidden[:1]).float().argmax(-1))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            g.graph.replay()
        torch.cuda.synchronize(dev)
    launch = [e for e in prof.key_averages() if e.key == "cudaGraphLaunch"]
    step_ms = statistics.median(times) * 1e3
    stepwise_ms = statistics.median(stepwise) * 1e3
    return {"model": model, "device": torch.cuda.get_device_name(dev), "step_ms": step_ms, "replay_ms": replay_ms,
            "lookahead_won": won, "step_stepwise_ms": stepwise_ms,
            "logits_argmax_ms": logits_ms, "host_ms": stepwise_ms - replay_ms - logits_ms,
            "graph_launch_cpu_us": launch[0].cpu_time_total / launch[0].count if launch else None,
            "kernels": _table(prof)}


def format_profile(r: dict[str, Any]) -> str:
    lines = ["host time to lay out a decode step (us): builder vs graph staging"]
    h = r["host"]
    for rows in (1, 64):
        lines.append(f"  batch {rows:>2}: builder {h[f'graph_builder_b{rows}_us']:8.1f}   staging "
                     f"{h[f'graph_staging_b{rows}_us']:8.1f}")
    lines.append(f"  eager step, 64 rows + a 256-token chunk: builder {h['eager_builder_64_rows_and_a_chunk_us']:.1f}")
    d = r.get("device_step")
    if d:
        lines.append(f"{d['model']} on {d['device']}, batch-1 decode with CUDA graphs (ms): step {d['step_ms']:.2f} "
                     f"with the lookahead ({d['lookahead_won']} of its steps computed ahead); one step at a time "
                     f"{d['step_stepwise_ms']:.2f} = replay {d['replay_ms']:.2f} + logits/argmax "
                     f"{d['logits_argmax_ms']:.2f} + host {d['host_ms']:.2f}; cudaGraphLaunch "
                     f"{d['graph_launch_cpu_us'] or 0:.0f} us of CPU")
        lines.append(d["kernels"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.engine_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="'cuda' adds the device step (section 2)")
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--calls", type=int, default=300, help="calls per host figure (their mean)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--out", default=DEFAULT_OUT, help="where to save the JSON figures")
    args = p.parse_args(argv)
    log("profile", "host layout of a decode step")
    figures: dict[str, Any] = {"host": host_layout(args.calls)}
    if args.device != "cpu":
        log("profile", f"batch-1 decode of {args.model} on {args.device}")
        figures["device_step"] = device_step(args.model, args.device)
    return emit("profile", figures, args.out, args.json, format_profile)


if __name__ == "__main__":
    sys.exit(main())
