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
from collections.abc import Callable
from typing import Any

from pdcluster.bench.engine_timing import DecodeStepTimer, interleaved_medians

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
    from engine import SamplingParams
    from engine.grammar import StructuredOutputSpec

    spec = StructuredOutputSpec.json_schema(SCHEMA)
    timer = DecodeStepTimer(loaded, args.threads, seed=7, prefix="g")

    def case(batch: int, grammar: bool) -> Callable[[], float]:
        params = (SamplingParams(max_tokens=steps + 2, temperature=0.0, structured=spec) if grammar else
                  SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
        return lambda: timer.ms(batch, params, steps)

    # NOTE: the warm-up of interleaved_medians compiles the grammar (once)
    medians = interleaved_medians({(b, g): case(b, g) for b in BATCHES for g in (False, True)}, args.grammar_rounds)
    out: dict[str, Any] = {"threads": args.threads, "rounds": args.grammar_rounds, "steps": steps,
                           "schema": json.dumps(SCHEMA), "cases": {}}
    for b in BATCHES:
        plain, grammar = medians[(b, False)], medians[(b, True)]
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
