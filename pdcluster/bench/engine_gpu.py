"""Correctness of the engine on a GPU (issue 26): the checks the `gpu` tests assert and scripts/gpu-check.sh records.

1. `device_matches_cpu`: random:smollm2-135m in float32, greedy, 8 prompts x 64 tokens, on the device and on the CPU
   (the same weights: random models are made bit for bit alike on every device). Each divergence is reported with
   the CPU's logit gap at that position (its top token's logit minus the device's token's): a near-tie is a gap
   below NEAR_TIE.
2. `bf16_matches_transformers`: random:smollm2-135m in bfloat16 on the device, our engine against transformers'
   generate with the same weights (also bfloat16 on the device), 10 prompts x 64 tokens; the figure is how many
   prompts come out identical (the issue asks >= 9 of 10). Each divergence is reported with transformers' logit gap
   there (its token's logit minus ours), teacher-forced on the common prefix.
NOTE: a random model's logits are nearly flat (the top two of 49,152 differ by ~0.1 where bf16 rounds at ~0.01), so
bf16 greedy runs of two implementations part at near-ties far more often than a trained model's do: on a CPU
(`bf16_matches_transformers("cpu", max_tokens=32)`), 7 of 10 prompts were identical and the 3 others parted where
transformers' own logits gave the two tokens gaps of 0, 0.0078 (one bf16 step) and 0. The check passes with
>= 9 of 10 identical, or when every divergence is such a near-tie (the figures say which).
So the check also measures transformers against itself on the same prompts (`transformers_self`): its SDPA
attention against its eager attention, both bf16 on the device, one batch each. That is the floor two correct bf16
implementations reach on this model: on the CPU transformers agreed with itself on 7 of 10 prompts (SDPA vs eager)
and 6 of 10 (a batch of 10 vs one prompt at a time), where ours agreed with it on 6.
`python -m pdcluster.bench.engine_gpu --out FILE [--device cuda]` runs both and writes one JSON object; the exit
status is 0 only when both pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

MODEL = "random:smollm2-135m"
NEAR_TIE = 0.05  # logits: float32 on two devices differ by ~1e-4 here; a flip above this is a bug, not rounding
BF16_NEAR_TIE = 0.125  # bf16 logits of magnitude 1-2 round at 1/128; two implementations' orders of sums differ


def make_prompts(n: int, length: int, vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of `length` ids (the same on every machine)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=gen).tolist()


def _engine(loaded: Any, device: str, dtype: str, max_num_seqs: int = 16) -> Any:
    from engine import EngineConfig, LLMEngine

    return LLMEngine(loaded, EngineConfig(device=device, dtype=dtype, num_blocks=1024, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=2048, enable_prefix_caching=False))


def device_matches_cpu(device: str = "cuda", num_prompts: int = 8, max_tokens: int = 64,
                       prompt_len: int = 32) -> dict[str, Any]:
    """Check 1 of the module docstring; `passed` when every divergence is a near-tie."""
    from engine.loader import load_model
    from engine.quality import greedy_outputs, sequence_logits

    t0 = time.perf_counter()
    on_device = load_model(MODEL, device=device, dtype="float32")
    on_cpu = load_model(MODEL, device="cpu", dtype="float32")
    same_weights = all(torch.equal(w.cpu(), on_cpu.weights[k]) for k, w in on_device.weights.items())
    prompts = make_prompts(num_prompts, prompt_len)
    ours = greedy_outputs(_engine(on_device, device, "float32"), prompts, max_tokens)
    cpu_engine = _engine(on_cpu, "cpu", "float32")
    ref = greedy_outputs(cpu_engine, prompts, max_tokens)
    divergences = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, ref)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        logits = sequence_logits(cpu_engine, [*prompt, *b[:j]])[-1]  # the CPU's logits where the two part
        top2 = logits.topk(2).values
        divergences.append({"prompt": i, "position": j, "cpu_token": b[j], "device_token": a[j],
                            "logit_gap": round(float(logits[b[j]] - logits[a[j]]), 6),
                            "cpu_top2_gap": round(float(top2[0] - top2[1]), 6)})
    return {"check": "float32 greedy, device vs CPU", "model": MODEL, "device": device, "same_weights": same_weights,
            "prompts": num_prompts, "tokens": max_tokens, "identical": num_prompts - len(divergences),
            "divergences": divergences, "near_tie": NEAR_TIE,
            "passed": same_weights and all(d["logit_gap"] < NEAR_TIE for d in divergences),
            "seconds": round(time.perf_counter() - t0, 1)}


@torch.inference_mode()
def hf_greedy(hf: Any, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    """transformers' greedy continuations of equal-length prompts, in one batch (no padding)."""
    ids = torch.tensor(prompts, device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                      do_sample=False, pad_token_id=0)
    return [row[len(prompts[0]):] for row in out.tolist()]


def bf16_matches_transformers(device: str = "cuda", num_prompts: int = 10, max_tokens: int = 64,
                              prompt_len: int = 32) -> dict[str, Any]:
    """Check 2 of the module docstring; `passed` when at least 9 of 10 prompts are identical."""
    from engine.loader import load_model
    from engine.quality import greedy_outputs
    from pdcluster.bench.reference import hf_model_from

    t0 = time.perf_counter()
    loaded = load_model(MODEL, device=device, dtype="bfloat16")
    hf: Any = hf_model_from(loaded).to(device=device, dtype=torch.bfloat16)
    prompts = make_prompts(num_prompts, prompt_len, seed=1)
    ours = greedy_outputs(_engine(loaded, device, "bfloat16"), prompts, max_tokens)
    theirs = hf_greedy(hf, prompts, max_tokens, device)
    divergences = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([[*prompt, *b[:j]]], device=device)).logits[0, -1].float()
        divergences.append({"prompt": i, "position": j, "transformers_token": b[j], "our_token": a[j],
                            "logit_gap": round(float(logits[b[j]] - logits[a[j]]), 4)})
    identical = num_prompts - len(divergences)
    near_ties = all(d["logit_gap"] < BF16_NEAR_TIE for d in divergences)
    hf.set_attn_implementation("eager")
    eager = hf_greedy(hf, prompts, max_tokens, device)
    self_identical = sum(a == b for a, b in zip(theirs, eager))
    return {"check": "bfloat16 greedy, ours vs transformers", "model": MODEL, "device": device,
            "prompts": num_prompts, "tokens": max_tokens, "identical": identical, "divergences": divergences,
            "transformers_self": {"check": "transformers SDPA vs transformers eager attention, bf16, same batch",
                                  "identical": self_identical},
            "near_tie": BF16_NEAR_TIE, "all_divergences_near_ties": near_ties,
            "passed": identical >= num_prompts - num_prompts // 10 or near_ties,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.engine_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="results/engine_gpu_check.json")
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    for name, check in (("device_vs_cpu", device_matches_cpu), ("bf16_vs_transformers", bf16_matches_transformers)):
        try:
            results[name] = check(args.device, max_tokens=args.tokens)
        except Exception as e:  # noqa: BLE001 (one failing check must not lose the other's figures)
            results[name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: results[name]}), flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return 0 if all(r.get("passed") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
