"""`pdcluster bench engine`, structured-output case: one decode step with a JSON-schema grammar on every row against
plain decoding (greedy), at batch 1 and 8, on the same engine in interleaved rounds (median kept); the grammar's
cost is printed and saved as a ratio grammar/plain of the same run (the target: at most 1.10 at batch 8).

The grammar's step does what a served request's does: the matchers fill the bitmask of the sampling rows, the
sampler masks the logits with it, and each sampled token advances its matcher. The schema forces a long output
(an array of 64 integers), so no row ends inside the measured steps; it is compiled once, in the warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": 64, "maxItems": 64}},
    "required": ["name", "kind", "values"]}
BATCHES = (1, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grammar-rounds", type=int, default=5, help="structured-output case: interleaved rounds")
    p.add_argument("--no-grammar", action="store_true", help="skip the structured-output case")


def measure_grammar(args: argparse.Namespace, loaded: Any, steps: int = 8) -> dict[str, Any]:
    """Median ms of one decode step with and without the grammar per batch, and their ratio."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.grammar import StructuredOutputSpec

    engine = LLMEngine(loaded, EngineConfig(num_threads=args.threads, max_num_batched_tokens=2048, max_num_seqs=16,
                                            enable_prefix_caching=False))
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    gen = torch.Generator().manual_seed(7)
    count = [0]

    def step_ms(batch: int, grammar: bool) -> float:
        for _ in range(batch):
            count[0] += 1
            prompt = torch.randint(100, loaded.config.vocab_size, (128,), generator=gen).tolist()
            params = (SamplingParams(max_tokens=steps + 2, temperature=0.0, structured=spec) if grammar else
                      SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
            engine.add_request(f"g{count[0]}", prompt, params)
        engine.step()  # the prompts (a grammar compiled in the warm-up is released in this same step)
        while engine.structured.num_parked:  # NOTE: only in the warm-up: the first compile
            engine.step()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - t) / steps
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed * 1e3

    cases = [(b, g) for b in BATCHES for g in (False, True)]
    for b, g in cases:  # warm-up (and the grammar's one compile)
        step_ms(b, g)
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _ in range(args.grammar_rounds):
        for b, g in cases:
            times[(b, g)].append(step_ms(b, g))
    out: dict[str, Any] = {"threads": args.threads, "rounds": args.grammar_rounds, "steps": steps,
                           "schema": json.dumps(SCHEMA), "cases": {}}
    for b in BATCHES:
        plain, grammar = statistics.median(times[(b, False)]), statistics.median(times[(b, True)])
        out["cases"][f"batch {b}"] = {"batch": b, "plain_ms": plain, "grammar_ms": grammar,
                                      "ratio_to_plain": grammar / plain}
    return out


def format_grammar(r: dict[str, Any]) -> str:
    lines = ["", f"structured outputs: one decode step with a JSON-schema grammar on every row, median ms of "
                 f"{r['rounds']} interleaved rounds ({r['threads']} thread(s); ratio = grammar / plain decoding)",
             f"{'case':12}{'plain ms':>10}{'grammar ms':>12}{'ratio':>9}"]
    for case, c in r["cases"].items():
        lines.append(f"{case:12}{c['plain_ms']:10.2f}{c['grammar_ms']:12.2f}{c['ratio_to_plain']:8.3f}x")
    return "\n".join(lines)
