"""`pdcluster bench engine`, per-core step case: one engine on one torch thread (as each worker of
deploy/bench-disagg.yaml runs), the engine's older paths ("before") against its current ones ("after").

Cases: prefill of a 96-token and a 1,000-token prompt alone (time to the first token, reported as prompt tokens/s),
32 new tokens behind a 900-token prompt the prefix cache holds (time to the first token), and one decode step at
batch 1, 4 and 8 over 128-token prompts, greedy, and at batch 8 sampled (temperature 0.8, top-p 0.95). Each case runs
under both settings in interleaved rounds, so load from other processes falls on both alike; the median of the
rounds is kept, and the ratio before/after is printed and saved. "before" = the switches of engine/model_runner.py at
their old values (`attn_prefill="chunked"`), the sampler it replaced (`_sample_before`: top-p by sorting the whole
vocabulary, the race's noise by Tensor.exponential_) and the linear layers on oneDNN's prepacked kernel instead of
the compiled one (engine/csrc/linear.cpp; the same weights, reordered for oneDNN once, before the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.bench.engine_timing import timed_steps

SETTINGS = ("before", "after")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-threads", type=int, default=1, help="per-core step case: torch threads of the engine")
    p.add_argument("--step-rounds", type=int, default=5, help="per-core step case: interleaved rounds (median)")
    p.add_argument("--no-step", action="store_true", help="skip the per-core step case")


def _sample_before(logits: torch.Tensor, rows: Any, bitmask: Any = None) -> Any:
    """engine.sampler.sample as it was before the top-p candidates and the -log(U) noise (the baseline only)."""
    from engine.sampler import SamplerOutput, step_seed

    tokens = logits.argmax(dim=-1).tolist()
    params, output_index = [r.params for r in rows], [r.num_output_tokens for r in rows]
    for i, p in enumerate(params):
        if p.greedy:
            continue
        x = logits[i] / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            sp = sorted_x.softmax(-1)
            drop = (sp.cumsum(-1) - sp) >= p.top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = x.softmax(-1)
        gen = torch.Generator().manual_seed(step_seed(p.seed or 0, output_index[i] + p.output_offset))
        tokens[i] = int((probs / torch.empty_like(probs).exponential_(generator=gen)).argmax())
    return SamplerOutput(torch.tensor(tokens))


def _linear_settings(engine: Any) -> dict[str, list[tuple[Any, str, Any]]]:
    """(owner, attribute, layer) for every linear layer of the model, per setting: "after" the layers as loaded,
    "before" the same weights on oneDNN's prepacked kernel (built once, here)."""
    from engine.linear import PackedLinear

    model = engine.runner.model
    slots = [(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    slots.append((model, "lm_head"))
    after = [(owner, name, getattr(owner, name)) for owner, name in slots]
    before = [(owner, name, lin if lin.backend == "onednn" else PackedLinear(lin.plain_weight(), lin.bias, "onednn"))
              for owner, name, lin in after]
    return {"before": before, "after": after}


def _apply(engine: Any, setting: str, linears: dict[str, list[tuple[Any, str, Any]]]) -> None:
    import engine.model_runner as runner_module
    from engine.sampler import sample

    engine.runner.attn_prefill = "chunked" if setting == "before" else "flash"
    runner_module.sample = _sample_before if setting == "before" else sample  # type: ignore[attr-defined]
    for owner, name, lin in linears[setting]:
        setattr(owner, name, lin)


def measure_step(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    """Median ms per case and setting, over interleaved rounds, on `--step-threads` threads."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    gen = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    engine = LLMEngine(loaded, EngineConfig(num_threads=args.step_threads, max_num_batched_tokens=2048,
                                            max_num_seqs=16, enable_prefix_caching=True))
    count = [0]

    def rand(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    def first_token(prompt: list[int]) -> float:
        count[0] += 1
        engine.add_request(f"s{count[0]}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    def decode_step(batch: int = 8, steps: int = 4, temperature: float = 0.0) -> float:
        for _ in range(batch):
            count[0] += 1
            engine.add_request(f"s{count[0]}", rand(128), SamplingParams(
                max_tokens=steps + 2, temperature=temperature, top_p=0.95 if temperature else 1.0, seed=count[0],
                ignore_eos=True))
        engine.step()  # the prompts (one step: 8 x 128 tokens fit the budget)
        return timed_steps(engine, steps)

    context = rand(900)
    first_token(context)  # cached from now on (896 tokens: 56 full blocks)
    cases: dict[str, tuple[int, Callable[[], float]]] = {
        "prefill 96": (96, lambda: first_token(rand(96))),
        "prefill 1000": (1000, lambda: first_token(rand(1000))),
        "32 over 900 cached": (32, lambda: first_token(context + rand(32))),
        "decode step, batch 1": (1, lambda: decode_step(batch=1)),
        "decode step, batch 4": (4, lambda: decode_step(batch=4)),
        "decode step, batch 8": (8, decode_step),
        "  sampled, top-p 0.95": (8, lambda: decode_step(temperature=0.8)),
    }
    linears = _linear_settings(engine)
    for _, fn in cases.values():  # warm-up
        fn()
    times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in SETTINGS} for c in cases}
    for _ in range(args.step_rounds):
        for case, (_, fn) in cases.items():
            for setting in SETTINGS:
                _apply(engine, setting, linears)
                times[case][setting].append(fn())
    _apply(engine, "after", linears)
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"threads": args.step_threads, "rounds": args.step_rounds, "cases": {}}
    for case, (tokens, _) in cases.items():
        ms = {s: statistics.median(times[case][s]) * 1e3 for s in SETTINGS}
        out["cases"][case] = {"tokens": tokens, "ms": ms, "tok_s": {s: tokens / ms[s] * 1e3 for s in SETTINGS},
                              "speedup": ms["before"] / ms["after"]}
    return out


def format_step(r: dict[str, Any]) -> str:
    lines = ["", f"per-core step, {r['threads']} torch thread(s): median ms of {r['rounds']} interleaved rounds "
                 "(before = attn_prefill chunked, the sampler before, oneDNN linears)",
             f"{'case':24}{'before ms':>11}{'after ms':>10}{'before tok/s':>14}{'after tok/s':>13}{'ratio':>8}"]
    for case, c in r["cases"].items():
        lines.append(f"{case:24}{c['ms']['before']:11.1f}{c['ms']['after']:10.1f}{c['tok_s']['before']:14.1f}"
                     f"{c['tok_s']['after']:13.1f}{c['speedup']:7.2f}x")
    return "\n".join(lines)
