"""`pdcluster bench engine`, request-features case: one decode step with a request feature on every row against
plain decoding (greedy, nothing else), at batch 1 and 8, on the same engine in interleaved rounds (median kept); the
overhead is printed and saved as a ratio feature/plain of the same run.

A feature is a name and the SamplingParams a row runs with (`FEATURES`); adding one is one entry.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pdcluster.bench.engine_timing import DecodeStepTimer, interleaved_medians

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
    from engine import SamplingParams

    timer = DecodeStepTimer(loaded, args.threads, seed=5, prefix="f")

    def case(batch: int, extra: dict[str, Any]) -> Callable[[], float]:
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True, **extra)
        return lambda: timer.ms(batch, params, steps)

    medians = interleaved_medians({(name, b): case(b, extra) for b in BATCHES for name, extra in FEATURES.items()},
                                  args.features_rounds)
    out: dict[str, Any] = {"threads": args.threads, "rounds": args.features_rounds, "steps": steps, "cases": {}}
    for (name, b), ms in medians.items():
        out["cases"][f"{name}, batch {b}"] = {"feature": name, "batch": b, "ms": ms,
                                              "ratio_to_plain": ms / medians[("plain", b)]}
    return out


def format_features(r: dict[str, Any]) -> str:
    lines = ["", f"request features: one decode step, median ms of {r['rounds']} interleaved rounds "
                 f"({r['threads']} thread(s); ratio = with the feature / plain decoding)",
             f"{'case':28}{'ms':>9}{'ratio':>9}"]
    for case, c in r["cases"].items():
        lines.append(f"{case:28}{c['ms']:9.2f}{c['ratio_to_plain']:8.3f}x")
    return "\n".join(lines)
