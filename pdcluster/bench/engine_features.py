"""`pdcluster bench engine`, request-features case: one decode step with a request feature on every row against
plain decoding (greedy, nothing else), at batch 1 and 8, on the same engine in interleaved rounds (median kept); the
overhead is printed and saved as a ratio feature/plain of the same run.

A feature is a name and the SamplingParams a row runs with (`FEATURES`); adding one is one entry.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# name → the settings of every row (greedy, EOS ignored, plus these); "plain" is the baseline
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs k=5": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}
BATCHES = (1, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--features-rounds", type=int, default=5, help="request-features case: interleaved rounds")
    p.add_argument("--no-features", action="store_true", help="skip the request-features case")


def measure_features(args: argparse.Namespace, loaded: Any, steps: int = 8) -> dict[str, Any]:
    """Median ms of one decode step per feature and batch, and its ratio to plain decoding."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_threads=args.threads, max_num_batched_tokens=2048, max_num_seqs=16,
                                            enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(5)
    count = [0]

    def step_ms(batch: int, extra: dict[str, Any]) -> float:
        for _ in range(batch):
            count[0] += 1
            prompt = torch.randint(100, loaded.config.vocab_size, (128,), generator=gen).tolist()
            engine.add_request(f"f{count[0]}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0,
                                                                      ignore_eos=True, **extra))
        engine.step()  # the prompts
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - t) / steps
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed * 1e3

    def timer(batch: int, extra: dict[str, Any]) -> Callable[[], float]:
        return lambda: step_ms(batch, extra)

    cases = {(name, b): timer(b, extra) for b in BATCHES for name, extra in FEATURES.items()}
    for fn in cases.values():  # warm-up
        fn()
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for _ in range(args.features_rounds):
        for case, fn in cases.items():
            times[case].append(fn())
    out: dict[str, Any] = {"threads": args.threads, "rounds": args.features_rounds, "steps": steps, "cases": {}}
    for (name, b), ts in times.items():
        ms = statistics.median(ts)
        plain = statistics.median(times[("plain", b)])
        out["cases"][f"{name}, batch {b}"] = {"feature": name, "batch": b, "ms": ms, "ratio_to_plain": ms / plain}
    return out


def format_features(r: dict[str, Any]) -> str:
    lines = ["", f"request features: one decode step, median ms of {r['rounds']} interleaved rounds "
                 f"({r['threads']} thread(s); ratio = with the feature / plain decoding)",
             f"{'case':28}{'ms':>9}{'ratio':>9}"]
    for case, c in r["cases"].items():
        lines.append(f"{case:28}{c['ms']:9.2f}{c['ratio_to_plain']:8.3f}x")
    return "\n".join(lines)
