"""`pdcluster bench engine`, LoRA case: one decode step of a batch of 8 with 4 adapters of rank 16 (two rows each,
interleaved in the batch; the engine groups them, engine/lora/slots.py `order`, so each linear's delta is one bmm
pair over a slice) against the base model's step, on an engine without LoRA and on the LoRA engine with base rows
only (what turning LoRA on costs a step that uses none); interleaved rounds, medians, ratios to the base engine's
step. Issue 41's goal: the adapter step within 1.3x of the base step on the CPU.

The adapters are random PEFT directories written here (q/k/v/o and gate/up/down of every layer, alpha 32).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.bench.engine_timing import DecodeStepTimer, interleaved_medians

ADAPTERS, RANK, BATCH = 4, 16, 8
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-rounds", type=int, default=5, help="LoRA case: interleaved rounds")
    p.add_argument("--no-lora", action="store_true", help="skip the LoRA case")


def write_adapter(path: str, loaded: Any, rank: int, seed: int) -> str:
    """A random PEFT adapter for `loaded`'s every layer and target module at `path`."""
    from safetensors.torch import save_file

    from engine.lora.adapter import TARGETS, part_sizes

    g = torch.Generator().manual_seed(seed)
    sizes, tensors = part_sizes(loaded.config), {}
    for layer in range(loaded.config.num_layers):
        for module, (linear, index) in TARGETS.items():
            out, inp = sizes[linear][index]
            stem = f"base_model.model.model.layers.{layer}.{'self_attn' if module in _ATTN else 'mlp'}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def measure_lora(args: argparse.Namespace, loaded: Any, steps: int = 8) -> dict[str, Any]:
    """Median ms of one decode step: base engine, LoRA engine with base rows, LoRA engine with 4 adapters."""
    from engine import SamplingParams

    base = DecodeStepTimer(loaded, args.threads, seed=7, prefix="lb")
    lora = DecodeStepTimer(loaded, args.threads, seed=7, prefix="la", max_loras=ADAPTERS, max_lora_rank=RANK)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ADAPTERS):
            lora.engine.load_lora(f"a{i}", write_adapter(os.path.join(tmp, f"a{i}"), loaded, RANK, seed=i))

    def params(name: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True, lora=name)

    rows = [params(f"a{i % ADAPTERS}") for i in range(BATCH)]
    cases: dict[str, Callable[[], float]] = {
        "base engine": lambda: base.ms(BATCH, params(None), steps),
        "LoRA engine, base rows": lambda: lora.ms(BATCH, params(None), steps),
        f"{ADAPTERS} adapters r{RANK}": lambda: lora.ms(BATCH, rows, steps),
    }
    medians = interleaved_medians(cases, args.lora_rounds)
    ref = medians["base engine"]
    return {"threads": args.threads, "rounds": args.lora_rounds, "steps": steps, "batch": BATCH,
            "adapters": ADAPTERS, "rank": RANK,
            "cases": {name: {"ms": ms, "ratio_to_base": ms / ref} for name, ms in medians.items()}}


def format_lora(r: dict[str, Any]) -> str:
    lines = ["", f"LoRA: one decode step at batch {r['batch']}, median ms of {r['rounds']} interleaved rounds "
                 f"({r['threads']} thread(s); ratio = case / the base engine's step; goal <= 1.3x)",
             f"{'case':28}{'ms':>9}{'ratio':>9}"]
    for case, c in r["cases"].items():
        lines.append(f"{case:28}{c['ms']:9.2f}{c['ratio_to_base']:8.3f}x")
    return "\n".join(lines)
