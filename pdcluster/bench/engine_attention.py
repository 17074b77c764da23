"""`pdcluster bench engine`, decode-attention case: one engine step at long context, gather path vs in-place kernel.

Batch 16 x 1,000-token prompts (defaults), decoding; twice: every prompt distinct ("unshared"), and every prompt
behind one 896-token common prefix served from the prefix cache ("shared"). The KV is computed once per case; then
the same engine's decode steps are timed with each attention path in turn (interleaved rounds, so load from other
processes falls on all of them alike): the pure-torch gather path, the in-place kernel without cascade, and the
in-place kernel with cascade (shared prefix read once per group). Step time = best round's mean over its steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

MODES = ("gather", "in-place", "in-place + cascade")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attn-batch", type=int, default=16, help="decode-attention case: sequences")
    p.add_argument("--attn-context", type=int, default=1000, help="decode-attention case: prompt tokens each")
    p.add_argument("--attn-shared", type=int, default=896, help="decode-attention case: common prefix tokens")
    p.add_argument("--attn-steps", type=int, default=3, help="decode steps per path per round")
    p.add_argument("--attn-rounds", type=int, default=3, help="interleaved rounds (best kept)")
    p.add_argument("--no-attention", action="store_true", help="skip the decode-attention case")


def _set_mode(engine: Any, kernel: Any, mode: str) -> None:
    engine.runner.attn_kernel = None if mode == "gather" else kernel
    engine.runner.attn_cascade = mode.endswith("cascade")


def _case(loaded: Any, args: argparse.Namespace, kernel: Any, shared: int, gen: torch.Generator) -> dict[str, Any]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    b, n = args.attn_batch, args.attn_context
    steps = args.attn_steps * args.attn_rounds * len(MODES) + 2
    engine = LLMEngine(loaded, EngineConfig(num_threads=args.threads, max_num_batched_tokens=max(2048, n),
                                            max_num_seqs=b, enable_prefix_caching=True))
    common = torch.randint(100, loaded.config.vocab_size, (shared,), generator=gen).tolist()
    prompts = [common + torch.randint(100, loaded.config.vocab_size, (n - shared,), generator=gen).tolist()
               for _ in range(b)]
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    _set_mode(engine, kernel, "in-place + cascade")
    engine.add_request("attn-0", prompts[0], dataclasses.replace(params))
    while engine.stats().computed_tokens < n:  # NOTE: the first prompt's blocks are cached before the others come
        engine.step()
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(f"attn-{i}", p, dataclasses.replace(params))
    started: set[str] = set()
    while len(started) < b:  # until every sequence has its first token: from then on every step is decode
        started.update(out.request_id for out in engine.step())
    best = {m: float("inf") for m in MODES}
    for _ in range(args.attn_rounds):
        for mode in MODES:
            _set_mode(engine, kernel, mode)
            t0 = time.perf_counter()
            for _ in range(args.attn_steps):
                engine.step()
            best[mode] = min(best[mode], (time.perf_counter() - t0) / args.attn_steps)
    base = best["gather"]
    return {"shared_prefix_tokens": shared, "cached_prompt_tokens": engine.stats().cached_prompt_tokens,
            "step_ms": {m: t * 1e3 for m, t in best.items()},
            "speedup_vs_gather": {m: base / t for m, t in best.items()}}


def measure_attention(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    """Decode step times of the attention paths at long context, unshared and shared prefix."""
    from engine.kernels import ensure_built

    kernel = ensure_built()
    gen = torch.Generator().manual_seed(2)
    cases = {}
    for name, shared in (("unshared", 0), ("shared", args.attn_shared)):
        log_fn(f"decode attention: batch {args.attn_batch} x {args.attn_context} tokens, {name} prefix")
        cases[name] = _case(loaded, args, kernel, shared, gen)
    return {"batch": args.attn_batch, "context": args.attn_context, "steps": args.attn_steps,
            "rounds": args.attn_rounds, **cases}


def log_fn(msg: str) -> None:
    from pdcluster.bench.report import log

    log("engine", msg)


def format_attention(r: dict[str, Any]) -> str:
    lines = ["", f"decode attention, batch {r['batch']} x {r['context']}-token prompts: ms per engine step "
                 f"(best of {r['rounds']} rounds of {r['steps']} steps)",
             f"{'prefix':10}" + "".join(f"{m:>22}" for m in MODES)]
    for name in ("unshared", "shared"):
        c = r[name]
        cells = "".join(f"{c['step_ms'][m]:12.1f} ({c['speedup_vs_gather'][m]:5.2f}x)" for m in MODES)
        label = name if not c["shared_prefix_tokens"] else f"{name} {c['shared_prefix_tokens']}"
        lines.append(f"{label:10}{cells}")
    return "\n".join(lines)
