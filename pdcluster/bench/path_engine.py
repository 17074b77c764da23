"""The engine alone: `pdcluster bench path`'s baseline (the decode pool's engine settings, in the bench's process).

It runs twice in a bench: once before the cluster starts (`figures`: every case, the engine's own line), and again
for each front while the cluster is up, each request or round right before the same one through the cluster on the
same prompt (`ttft_s`, `steps_s`, `stream_s`): on a shared machine a slow spell of a minute moved a ratio taken
minutes apart by more than the path costs, and the two sides of a pair see the same spell.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pdcluster.bench import cluster_proc

TTFT_TOKENS = 8  # tokens of each TTFT request (8, not 1: a request that ends at its first token never waits for the KV)


def ms(s: float) -> float:
    return round(s * 1e3, 2)


@dataclass
class Cases:
    """Each case's prompts; no prompt serves two cases (one seen before would be a prefix-cache hit)."""

    warm: list[list[int]]  # the warm-up's (2)
    ttft: list[list[int]]  # the TTFT case's, one request at a time (`--ttft-requests`)
    itl: list[list[int]]  # the batch-1 ITL case's, one per round (`--itl-rounds`)
    one: list[list[int]]  # the 1-stream case's, one per round (`--one-rounds`)
    many: list[list[int]]  # the N-stream case's first round (`--streams`)

    @staticmethod
    def count(args: argparse.Namespace) -> int:
        return 2 + args.ttft_requests + args.itl_rounds + args.one_rounds + args.streams

    @classmethod
    def of(cls, prompts: list[list[int]], args: argparse.Namespace) -> Cases:
        sizes = (2, args.ttft_requests, args.itl_rounds, args.one_rounds, args.streams)
        return cls(*(prompts[a:b] for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))))


def summary(ttft: list[float], steps: list[float], ones: list[tuple[float, list[float]]], many_s: float,
            many: int, args: argparse.Namespace) -> dict[str, float]:
    """The engine alone's figures of one go at the cases: first tokens (s), batch-1 steps (s), the 1-stream runs
    (`stream_s` each), and the seconds of `many` streams at once."""
    return {"ttft_ms_p50": ms(statistics.median(ttft)), "step_ms_p50": ms(statistics.median(steps)),
            "tok_s_1": statistics.median(args.stream_tokens / s for s, _ in ones),
            "step_ms_mean_1": ms(statistics.mean(x for _, st in ones for x in st)),
            f"tok_s_{args.streams}": many * args.stream_tokens / many_s}


class EngineAlone:
    """One engine in this process, stepped by hand (greedy, `ignore_eos`): first tokens, steps, whole runs."""

    def __init__(self, loaded: Any, config_path: str) -> None:
        import torch

        from engine import LLMEngine

        ecfg = cluster_proc.load(config_path).decode.engine_config()
        if ecfg.num_threads:
            torch.set_num_threads(ecfg.num_threads)
        self.engine = LLMEngine(loaded, ecfg)
        self._n = 0

    def run(self, batch: list[list[int]], tokens: int) -> tuple[list[float], list[float], float]:
        """First-token times (s), every step's time (s), and the whole run's seconds."""
        from engine import SamplingParams

        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        for p in batch:
            self._n += 1
            self.engine.add_request(f"alone-{self._n}", p, params)
        firsts: list[float] = []
        steps: list[float] = []
        while self.engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = self.engine.step()
            now = time.perf_counter()
            steps.append(now - t)
            firsts += [now - t0 for o in outs if len(o.token_ids) == 1 and o.new_token_ids]
        return firsts, steps, time.perf_counter() - t0

    def ttft_s(self, prompt: list[int]) -> float:
        """The TTFT case of one prompt: its first token's time."""
        return self.run([prompt], TTFT_TOKENS)[0][0]

    def steps_s(self, prompt: list[int], tokens: int) -> list[float]:
        """The ITL case: the decode steps at batch 1 (the prefill's step left out)."""
        return self.run([prompt], tokens)[1][1:]

    def stream_s(self, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
        """One stream of `tokens`: its seconds and its steps."""
        _, steps, seconds = self.run([prompt], tokens)
        return seconds, steps

    def figures(self, cases: Cases, args: argparse.Namespace) -> dict[str, Any]:
        """Every case (before the cluster starts): TTFT, the batch-1 step, tokens/s of 1 and of N streams."""
        self.run(cases.warm, 4)
        ttft = [self.ttft_s(p) for p in cases.ttft]
        steps = [s for p in cases.itl for s in self.steps_s(p, args.itl_tokens)]
        ones = [self.stream_s(p, args.stream_tokens) for p in cases.one]
        return summary(ttft, steps, ones, self.run(cases.many, args.stream_tokens)[2], len(cases.many), args)
