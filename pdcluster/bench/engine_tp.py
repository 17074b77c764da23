"""`pdcluster bench engine --tensor-parallel-size N`: step times of one engine at TP 1 and at TP N (engine/parallel/),
and the all-reduce share of the TP N step.

Cases, each timed on both engines in interleaved rounds (median kept, so load from other processes falls on both):
prefill of one --prefill-len prompt alone (the step's time: one step takes the whole prompt), one decode step at
each of --tp-batches over --decode-prompt-len prompts, greedy, and the KV hand-off's reads and writes of a
--prefill-len prompt's blocks, every layer (what a TP group adds to its sender and receiver: every rank's heads
copied out of and into its pool, mapped on rank 0 on the CPU, engine/parallel/shared_pool.py; through the followers'
KV threads with PDCLUSTER_TP_KV=threads, as on CUDA: engine/parallel/kv.py). The all-reduce share is rank 0's wall
time inside the row-parallel all-reduces over the step's (2 per layer; waiting for a slower rank counts, since the
step waits too);
the gather share, inside the gather of the LM head's logits on rank 0 (each rank computes its vocabulary columns).
Threads: --threads is the machine's share for the engine; TP 1 gets all of it, each of the N ranks 1/N (at least 1),
so both engines use the same cores. On a CPU of 2 cores shared with other work the figures say what the group costs
(messages, all-reduces, duplicated host work), not what TP gains on GPUs.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.bench.engine_timing import interleaved_medians
from pdcluster.bench.report import log, machine

DEFAULT_OUT = "results/bench_engine_tp.json"
ALLREDUCE = {"shm": "shared memory", "gloo": "gloo"}
STEPS = {"pipe": "a pipe per follower", "gloo": "gloo"}
KV_PATHS = {"shared": "the followers' pools mapped on rank 0", "threads": "the followers' KV threads"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="the TP bench (this module's figures): TP 1 against TP N instead of the CPU engine bench")
    p.add_argument("--tp-batches", default="1,8", help="--tensor-parallel-size: decode batch sizes")
    p.add_argument("--tp-rounds", type=int, default=3, help="--tensor-parallel-size: interleaved rounds (median)")


class _Engine:
    """One engine of the comparison, with its own request ids and the all-reduce clock of its rank 0."""

    def __init__(self, loaded: Any, tp: int, threads: int, budget: int) -> None:
        from engine import EngineConfig, LLMEngine

        self.tp = tp
        self.engine = LLMEngine(loaded, EngineConfig(
            tensor_parallel_size=tp, num_threads=max(1, threads // tp), max_num_batched_tokens=budget,
            max_num_seqs=64, num_blocks=2048, enable_prefix_caching=False))
        self.count = 0
        self.allreduce_s = 0.0  # over the timed steps only
        self.allreduce_calls = 0
        self.gather_s = 0.0
        self.timed_s = 0.0

    def _clock(self) -> tuple[float, int, float]:
        """Rank 0's all-reduce seconds and calls so far, and its logits-gather seconds."""
        group = getattr(self.engine.runner, "group", None)
        return (0.0, 0, 0.0) if group is None else (group.stats.seconds, group.stats.calls, group.gathers.seconds)

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from engine import SamplingParams

        self.count += 1
        self.engine.add_request(f"tp{self.count}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))

    def steps(self, steps: int) -> float:
        """Seconds per step over the next `steps` steps, whose all-reduce time goes on this engine's clock; then the
        engine runs until nothing is left (untimed)."""
        (ar_s, ar_calls, g_s), start = self._clock(), time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        elapsed = time.perf_counter() - start
        now = self._clock()
        self.allreduce_s += now[0] - ar_s
        self.allreduce_calls += now[1] - ar_calls
        self.gather_s += now[2] - g_s
        self.timed_s += elapsed
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return elapsed / steps


def measure_tp(args: argparse.Namespace) -> dict[str, Any]:
    """Median ms per case at TP 1 and TP N, and TP N's all-reduce share per case."""
    from engine.loader import load_model

    n = args.tensor_parallel_size
    batches = [int(b) for b in args.tp_batches.split(",")]
    log("engine", f"loading {args.model}")
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(4)
    budget = max(args.prefill_len, max(batches) * args.decode_prompt_len)
    engines = {tp: _Engine(loaded, tp, args.threads, budget) for tp in (1, n)}

    def rand(length: int) -> list[int]:
        return torch.randint(100, vocab, (length,), generator=gen).tolist()

    def prefill(e: _Engine) -> float:
        e.add(rand(args.prefill_len), 1)
        return e.steps(1)  # NOTE: the whole prompt fits the step's budget: one step, its first token

    def decode(e: _Engine, batch: int, steps: int = 4) -> float:
        for _ in range(batch):
            e.add(rand(args.decode_prompt_len), steps + 2)
        e.engine.step()  # the prompts
        return e.steps(steps)

    def kv_blocks(e: _Engine, op: str) -> float:
        """Every layer's K and V of a --prefill-len prompt's blocks, read (`read_blocks`) or written (`write_blocks`)
        in the full model's layout, as the KV hand-off's sender and receiver do: TP n gathers and scatters the heads
        over its ranks' pools. (Free blocks of an idle engine: what they hold does not matter.)"""
        runner = e.engine.runner
        blocks = list(range(-(-args.prefill_len // e.engine.config.block_size)))
        k, v = runner.read_blocks(0, blocks)
        start = time.perf_counter()
        for layer in range(loaded.config.num_layers):
            if op == "read":
                runner.read_blocks(layer, blocks)
            else:
                runner.write_blocks(layer, 0, blocks, k)
                runner.write_blocks(layer, 1, blocks, v)
        elapsed = time.perf_counter() - start
        e.timed_s += elapsed
        return elapsed

    rows: dict[str, dict[str, Any]] = {}
    group = getattr(engines[n].engine.runner, "group", None)
    allreduce = "shm" if group is not None and group.shm is not None else "gloo"  # engine/parallel/shm_allreduce.py
    steps = "pipe" if group is not None and group.steps is not None else "gloo"  # engine/parallel/step_channel.py
    gather = getattr(engines[n].engine.runner, "kv_gather", None)
    kv_path = "shared" if gather is not None and gather.pools else "threads"  # engine/parallel/shared_pool.py
    try:
        case_fns: dict[str, Callable[[_Engine], float]] = {f"prefill {args.prefill_len}": prefill}
        case_fns |= {f"decode step, batch {b}": functools.partial(decode, batch=b) for b in batches}
        case_fns |= {f"KV {op} {args.prefill_len} tokens": functools.partial(kv_blocks, op=op)
                     for op in ("read", "write")}
        for case, fn in case_fns.items():
            log("engine", f"TP 1 vs TP {n}: {case}")
            for e in engines.values():
                e.allreduce_s = e.timed_s = e.gather_s = 0.0
                e.allreduce_calls = 0
            medians = interleaved_medians({tp: functools.partial(fn, e) for tp, e in engines.items()},
                                          args.tp_rounds)
            tp_n = engines[n]
            rows[case] = {"tp1_ms": medians[1] * 1e3, f"tp{n}_ms": medians[n] * 1e3,
                          "speedup": medians[1] / medians[n],
                          "allreduce_share": tp_n.allreduce_s / tp_n.timed_s if n > 1 else 0.0,
                          "allreduce_ms_per_call": tp_n.allreduce_s * 1e3 / max(1, tp_n.allreduce_calls),
                          "gather_share": tp_n.gather_s / tp_n.timed_s if n > 1 else 0.0}
    finally:
        for e in engines.values():
            e.engine.close()
    cfg = loaded.config
    return {"model": cfg.name, "model_id": cfg.model_id, "dtype": "float32", "tensor_parallel_size": n,
            "threads": args.threads, "threads_per_rank": max(1, args.threads // n), "machine": machine(),
            "heads": {"q": cfg.num_heads, "kv": cfg.num_kv_heads}, "allreduces_per_step": 2 * cfg.num_layers,
            "rounds": args.tp_rounds, "allreduce": allreduce, "step_messages": steps, "kv_path": kv_path,
            "cases": rows}


def format_tp(r: dict[str, Any]) -> str:
    n = r["tensor_parallel_size"]
    lines = [f"model {r['model']} ({r['model_id']}), fp32, TP 1 on {r['threads']} threads vs TP {n} on "
             f"{r['threads_per_rank']} per rank (all-reduce: {ALLREDUCE[r['allreduce']]}, step messages: "
             f"{STEPS[r['step_messages']]}, KV hand-off: {KV_PATHS[r.get('kv_path', 'threads')]}), median of "
             f"{r['rounds']} "
             "interleaved rounds; "
             f"{r['allreduces_per_step']} all-reduces per step",
             f"{'case':28}{'TP 1 ms':>10}{f'TP {n} ms':>10}{'TP1/TPn':>9}{'all-reduce share':>18}"
             f"{'ms per all-reduce':>19}{'logits gather share':>21}"]
    for case, row in r["cases"].items():
        lines.append(f"{case:28}{row['tp1_ms']:10.2f}{row[f'tp{n}_ms']:10.2f}{row['speedup']:8.2f}x"
                     f"{row['allreduce_share']:18.1%}{row['allreduce_ms_per_call']:19.3f}"
                     f"{row['gather_share']:21.1%}")
    return "\n".join(lines)
