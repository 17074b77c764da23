"""How `pdcluster bench engine` times things, shared by its cases: our engine on a batch of prompts (`OursTimer`),
transformers' generate on the same weights (`ReferenceTimer`), one decode step of a fresh batch
(`DecodeStepTimer`), best-of and interleaved-median rounds.

Imports only torch and the engine (lazily), so the device bench runs on a GPU node without the CLI's dependencies.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best(repeats: int, fn: Callable[..., tuple[float, ...]]) -> tuple[float, ...]:
    """The smallest of each figure of `fn()` over `repeats` runs (`fn` takes no argument but its defaults)."""
    runs = [fn() for _ in range(repeats)]
    return tuple(min(col) for col in zip(*runs))


def interleaved_medians(cases: dict[K, Callable[[], float]], rounds: int) -> dict[K, float]:
    """Each case once (warm-up), then `rounds` rounds of every case in turn; the median of each case's figures."""
    for fn in cases.values():
        fn()
    times: dict[K, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for case, fn in cases.items():
            times[case].append(fn())
    return {c: statistics.median(ts) for c, ts in times.items()}


def timed_steps(engine: Any, steps: int) -> float:
    """Seconds per engine step over the next `steps` steps; then the engine is run until nothing is left."""
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - t) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


class OursTimer:
    """Times our engine: prompts go in together, one continuous batch (each step ends in its one sync)."""

    def __init__(self, loaded: Any, **config: Any) -> None:
        from engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False, **config))
        self.n = 0

    def run(self, prompts: list[list[int]], new_tokens: int, ignore_eos: bool = True) -> tuple[float, float]:
        """(seconds to the first token of every prompt, seconds to the last token)."""
        from engine import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=ignore_eos)
        t0 = time.perf_counter()
        for p in prompts:
            self.n += 1
            self.engine.add_request(f"bench-{self.n}", p, params)
        first, started = None, set()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                started.add(out.request_id)
            if first is None and len(started) == len(prompts):
                first = time.perf_counter() - t0
        return first or 0.0, time.perf_counter() - t0


class ReferenceTimer:
    """Times transformers' generate on the same weights (batch of equal-length prompts: no padding)."""

    def __init__(self, loaded: Any, device: torch.device | None = None) -> None:
        from pdcluster.bench.reference import hf_model_from

        self.device = device or torch.device("cpu")
        self.model: Any = hf_model_from(loaded)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds for `new_tokens` greedy tokens of every prompt, the device synchronized around them."""
        ids = torch.tensor(prompts, device=self.device)
        sync(self.device)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(self.device)
        return time.perf_counter() - t0


class DecodeStepTimer:
    """Times one decode step of a batch of fresh random prompts on one engine (the bench's per-step cases)."""

    def __init__(self, loaded: Any, threads: int, seed: int, prefix: str, prompt_len: int = 128,
                 **options: Any) -> None:
        from engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(loaded, EngineConfig(num_threads=threads, max_num_batched_tokens=2048,
                                                     max_num_seqs=16, enable_prefix_caching=False, **options))
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.prefix, self.prompt_len, self.n = loaded.config.vocab_size, prefix, prompt_len, 0

    def ms(self, batch: int, params: Any, steps: int) -> float:
        """Milliseconds per decode step over `steps` steps of `batch` new rows with `params` (a list: row i gets
        params[i % len(params)])."""
        for i in range(batch):
            self.n += 1
            prompt = torch.randint(100, self.vocab, (self.prompt_len,), generator=self.gen).tolist()
            row = params[i % len(params)] if isinstance(params, list) else params
            self.engine.add_request(f"{self.prefix}{self.n}", prompt, row)
        self.engine.step()  # the prompts (a grammar compiled in the warm-up is released in this same step)
        while self.engine.structured.num_parked:  # NOTE: only in a grammar's warm-up: its first compile
            self.engine.step()
        return timed_steps(self.engine, steps) * 1e3
