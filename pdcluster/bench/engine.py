"""`pdcluster bench engine`: our engine vs transformers' generate, same weights, prompts and threads, one process.

Reports prefill and decode tok/s at several batch sizes with the ratio ours/transformers, and the memory-bandwidth
bound of batch-1 decode (weight bytes ÷ read bandwidth measured in this run) with our fraction of it.
Definitions (identical for both): prefill tok/s = B × prompt_len ÷ time to the first token of all B prompts;
decode tok/s = B × (N − 1) ÷ (time for N tokens − time for the first). Best of --repeats runs, fresh prompts each.
Then (unless --no-step) the per-core step case, one torch thread, the engine's older paths against its
current ones (pdcluster/bench/engine_step.py). Then (unless --no-attention) one decode step at long context with
the gather path against the in-place attention kernel and its cascade over a shared prefix
(pdcluster/bench/engine_attention.py). Then (unless --no-variants) the decode-bound options in the same run:
decode tok/s at batch 1 and 8 for float32, int8 weights and int8 weights + int8 KV, with their quality against
float32 (teacher-forced top-1 agreement over 32 greedy tokens of varied prompts, perplexity on a fixed text); and
n-gram speculation on a repetitive task (copying an edited text) against the same engine without it,
with the acceptance rate. Then (unless --no-features) one decode step with a request feature on every row (logprobs
k = 5, penalties) against plain decoding at batch 1 and 8 (pdcluster/bench/engine_features.py). Then (unless
--no-grammar) one decode step with a JSON-schema grammar on every row against plain decoding at batch 1 and 8
(pdcluster/bench/engine_grammar.py). Then (unless --no-lora) one decode step at batch 8 with 4 LoRA adapters of
rank 16 against the base model's step (pdcluster/bench/engine_lora.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from pdcluster.bench.engine_attention import add_arguments as add_attention_arguments
from pdcluster.bench.engine_attention import format_attention, measure_attention
from pdcluster.bench.engine_device import DEFAULT_OUT as DEFAULT_DEVICE_OUT
from pdcluster.bench.engine_device import add_arguments as add_device_arguments
from pdcluster.bench.engine_device import format_device, measure_device
from pdcluster.bench.engine_features import add_arguments as add_features_arguments
from pdcluster.bench.engine_features import format_features, measure_features
from pdcluster.bench.engine_grammar import add_arguments as add_grammar_arguments
from pdcluster.bench.engine_grammar import format_grammar, measure_grammar
from pdcluster.bench.engine_lora import add_arguments as add_lora_arguments
from pdcluster.bench.engine_lora import format_lora, measure_lora
from pdcluster.bench.engine_step import add_arguments as add_step_arguments
from pdcluster.bench.engine_step import format_step, measure_step
from pdcluster.bench.engine_timing import OursTimer, ReferenceTimer, best
from pdcluster.bench.engine_tp import DEFAULT_OUT as DEFAULT_TP_OUT
from pdcluster.bench.engine_tp import add_arguments as add_tp_arguments
from pdcluster.bench.engine_tp import format_tp, measure_tp
from pdcluster.bench.report import emit, log, machine

DEFAULT_OUT = "results/bench_engine.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny', 'random:<arch>' (e.g. random:llama-3.1-8b), "
                                                      "a .gguf file or a Hugging Face directory")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads for both engines")
    p.add_argument("--batches", default="1,8,16", help="comma-separated batch sizes")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens for the prefill measurement")
    p.add_argument("--decode-prompt-len", type=int, default=128, help="prompt tokens before decoding")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per sequence when decoding")
    p.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is kept")
    p.add_argument("--no-reference", action="store_true", help="skip transformers (ours only)")
    p.add_argument("--quantization", choices=["int8"], default=None, help="ours: int8 weight-only linear layers")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="ours: KV cache storage")
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help='ours: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--no-variants", action="store_true", help="skip the quantization and speculation comparison")
    p.add_argument("--variant-batches", default="1,8", help="batch sizes of the variant comparison")
    add_attention_arguments(p)
    add_step_arguments(p)
    add_features_arguments(p)
    add_device_arguments(p)
    add_grammar_arguments(p)
    add_lora_arguments(p)
    add_tp_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--out", default=DEFAULT_OUT, help="where to save the JSON figures")


def _log(msg: str) -> None:
    log("engine", msg)


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Sustained read bandwidth (GB/s): sum over a buffer far larger than the caches, best of `repeats`."""
    buf = torch.ones(mib * 2**20 // 4)
    fastest = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        buf.sum()
        fastest = min(fastest, time.perf_counter() - t)
    return buf.numel() * 4 / fastest / 1e9


def _ours(loaded: object, threads: int, budget: int, **options: Any) -> OursTimer:
    """Our engine for these figures: `threads` torch threads, one continuous batch of up to 256 rows."""
    return OursTimer(loaded, num_threads=threads, max_num_batched_tokens=budget, max_num_seqs=256, **options)


def measure(args: argparse.Namespace) -> dict:
    from engine.loader import load_model

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    _log(f"loading {args.model}")
    loaded = load_model(args.model)
    cfg = loaded.config
    budget = max(2048, args.prefill_len, max(batches) * args.decode_prompt_len)
    options = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "speculative_config": args.speculative_config}
    ours = _ours(loaded, args.threads, budget, **options)
    ref = None if args.no_reference else ReferenceTimer(loaded)
    gen = torch.Generator().manual_seed(0)

    def prompts(b: int, n: int) -> list[list[int]]:
        return torch.randint(100, cfg.vocab_size, (b, n), generator=gen).tolist()

    ours.run(prompts(2, 32), 4)  # warm-up (allocator, oneDNN kernels)
    if ref:
        ref.run(prompts(2, 32), 4)
    results: dict[str, dict[str, dict[str, float]]] = {"prefill": {}, "decode": {}}
    for b in batches:
        _log(f"batch {b}: prefill {args.prefill_len} tokens")

        def prefill_once(b: int = b) -> tuple[float, float]:
            p = prompts(b, args.prefill_len)
            return ours.run(p, 1)[0], (ref.run(p, 1) if ref else 0.0)

        def decode_once(b: int = b) -> tuple[float, float]:
            p = prompts(b, args.decode_prompt_len)
            first, total = ours.run(p, args.decode_tokens)
            ref_decode = (ref.run(p, args.decode_tokens) - ref.run(p, 1)) if ref else 0.0
            return total - first, ref_decode

        pre = best(args.repeats, prefill_once)
        _log(f"batch {b}: decode {args.decode_tokens} tokens after {args.decode_prompt_len}")
        dec = best(args.repeats, decode_once)
        for kind, (t_ours, t_ref), n_tok in (("prefill", pre, b * args.prefill_len),
                                              ("decode", dec, b * (args.decode_tokens - 1))):
            row = {"ours_tok_s": n_tok / t_ours}
            if ref:
                row |= {"transformers_tok_s": n_tok / t_ref, "ratio": t_ref / t_ours}
            results[kind][str(b)] = row
    weight_bytes = sum(t.numel() * t.element_size() for name, t in loaded.weights.items()
                       if name != "model.embed_tokens.weight" or cfg.tie_word_embeddings)
    bw = read_bandwidth_gbs(args.threads)
    bound = bw * 1e9 / weight_bytes
    ours_b1 = results["decode"].get("1", {}).get("ours_tok_s")
    return {
        "model": cfg.name, "model_id": cfg.model_id, "dtype": "float32", "threads": args.threads, "options": options,
        "machine": machine(),
        "workload": {"prefill_len": args.prefill_len, "decode_prompt_len": args.decode_prompt_len,
                     "decode_tokens": args.decode_tokens, "repeats": args.repeats},
        **results,
        "bandwidth": {"read_gb_s": bw, "weight_bytes": weight_bytes, "decode_bound_tok_s_batch1": bound,
                      "ours_fraction_of_bound": (ours_b1 / bound) if ours_b1 else None},
        **({} if args.no_variants else {"variants": measure_variants(args, loaded)}),
        **({} if args.no_attention else {"decode_attention": measure_attention(args, loaded)}),
        **({} if args.no_step else {"step": measure_step(args, loaded)}),
        **({} if args.no_features else {"features": measure_features(args, loaded)}),
        **({} if args.no_grammar else {"grammar": measure_grammar(args, loaded)}),
        **({} if args.no_lora else {"lora": measure_lora(args, loaded)}),
    }


def format_table(r: dict) -> str:
    lines = [f"model {r['model']} ({r['model_id']}), fp32, {r['threads']} threads, torch {r['machine']['torch']}",
             f"{'':8}{'batch':>6}{'ours tok/s':>13}{'transformers':>14}{'ratio':>8}"]
    for kind in ("prefill", "decode"):
        for b, row in r[kind].items():
            ref = f"{row['transformers_tok_s']:14.1f}{row['ratio']:7.2f}x" if "ratio" in row else ""
            lines.append(f"{kind:8}{b:>6}{row['ours_tok_s']:13.1f}{ref}")
    bw = r["bandwidth"]
    frac = bw["ours_fraction_of_bound"]
    lines.append(f"read bandwidth {bw['read_gb_s']:.1f} GB/s, weights {bw['weight_bytes'] / 1e6:.0f} MB -> batch-1 "
                 f"decode bound {bw['decode_bound_tok_s_batch1']:.1f} tok/s"
                 + (f"; ours {frac:.0%} of it" if frac else ""))
    if "variants" in r:
        lines.append(format_variants(r["variants"]))
    if "decode_attention" in r:
        lines.append(format_attention(r["decode_attention"]))
    if "step" in r:
        lines.append(format_step(r["step"]))
    if "features" in r:
        lines.append(format_features(r["features"]))
    if "grammar" in r:
        lines.append(format_grammar(r["grammar"]))
    if "lora" in r:
        lines.append(format_lora(r["lora"]))
    return "\n".join(lines)


VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {}, "int8 weights": {"quantization": "int8"},
    "int8 weights + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"}}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
QUALITY_PROMPTS = ["What is the capital of Japan?", "Write a short poem about the ocean.",
                   "Explain in two sentences why the sky is blue.", "def merge_sort(items):",
                   "Give three tips for learning a new language.", "Translate to French: I like green apples."]
QUALITY_TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. It spans nine countries and "
                "holds the largest variety of plant and animal species on Earth. Scientists warn that deforestation "
                "threatens this ecosystem and the climate of the whole planet.")
EDIT_TEXT = ("The old lighthouse stood on the rocky cape for more than a century. Every evening the keeper climbed the "
             "narrow stairs, trimmed the wick and lit the great lamp, whose beam swept across the dark water to warn "
             "passing ships of the reef below. In winter, storms battered the tower and the keeper kept watch through "
             "the night, writing the weather, the ships he saw and the hours of the light in a worn leather logbook.")


def _decode_tok_s(eng: OursTimer, prompts: list[list[int]], n: int) -> float:
    first, total = eng.run(prompts, n)
    return len(prompts) * (n - 1) / (total - first)


def measure_variants(args: argparse.Namespace, loaded: Any) -> dict:
    """Decode tok/s and quality of the quantization options, and n-gram speculation on a repetitive task."""
    from engine.quality import greedy_outputs, perplexity, top1_agreement

    batches = [int(b) for b in args.variant_batches.split(",")]
    tok, cfg = loaded.tokenizer, loaded.config
    gen = torch.Generator().manual_seed(1)
    budget = max(2048, max(batches) * args.decode_prompt_len)
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in QUALITY_PROMPTS]
    text = tok.encode(QUALITY_TEXT)
    refs: list[list[int]] = []
    rows: dict[str, dict[str, Any]] = {}
    for name, options in VARIANTS.items():
        _log(f"variant {name}")
        eng = _ours(loaded, args.threads, budget, **options)
        eng.run(torch.randint(100, cfg.vocab_size, (2, 32), generator=gen).tolist(), 4)  # warm-up
        row: dict[str, Any] = {"options": options, "kv_bytes_per_block_layer": eng.engine.kv_layout.layer_nbytes(1)}
        for b in batches:
            row[f"decode_tok_s_b{b}"] = max(_decode_tok_s(eng, torch.randint(
                100, cfg.vocab_size, (b, args.decode_prompt_len), generator=gen).tolist(), args.decode_tokens)
                for _ in range(args.repeats))
        refs = refs or greedy_outputs(eng.engine, chat, 32)
        row["top1_agreement"] = top1_agreement(eng.engine, chat, refs)
        row["perplexity"] = perplexity(eng.engine, text)
        rows[name] = row
    edit = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Copy the following text, changing "
                                                "'keeper' to 'guardian' and nothing else:\n\n" + EDIT_TEXT}]))
    spec: dict[str, dict[str, Any]] = {}
    n = max(args.decode_tokens, 64)
    for b in batches:
        _log(f"speculation: batch {b}, {n} tokens of an edited copy")
        row = {}
        for name, sc in (("plain", None), ("ngram", SPEC)):
            eng = _ours(loaded, args.threads, budget, speculative_config=sc)
            eng.run([edit[:32]], 4)  # warm-up
            row[f"{name}_tok_s"] = max(_decode_tok_s(eng, [edit] * b, n) for _ in range(args.repeats))
            st = eng.engine.stats()
            if sc:
                row["acceptance_rate"] = st.spec_accepted_tokens / max(st.spec_draft_tokens, 1)
        row["speedup"] = row["ngram_tok_s"] / row["plain_tok_s"]
        spec[str(b)] = row
    return {"batches": batches, "quantization": rows, "speculation": {"config": SPEC, "decode_tokens": n,
                                                                       "prompt_tokens": len(edit), **spec}}


def format_variants(v: dict) -> str:
    bs = v["batches"]
    lines = ["", f"{'decode tok/s':26}" + "".join(f"{'batch ' + str(b):>10}{'vs fp32':>9}" for b in bs)
             + f"{'top-1 agree':>13}{'ppl':>8}{'KV B/block/layer':>18}"]
    base = v["quantization"]["fp32"]
    for name, row in v["quantization"].items():
        tps = [(row[f"decode_tok_s_b{b}"], base[f"decode_tok_s_b{b}"]) for b in bs]
        cells = "".join(f"{t:10.1f}{t / t0:8.2f}x" for t, t0 in tps)
        lines.append(f"{name:26}{cells}{row['top1_agreement']:12.1%}{row['perplexity']:9.2f}"
                     f"{row['kv_bytes_per_block_layer']:18d}")
    s = v["speculation"]
    lines += ["", f"n-gram speculation {s['config']}, copy-with-edits task ({s['prompt_tokens']} prompt tokens, "
                  f"{s['decode_tokens']} generated)",
              f"{'batch':>6}{'plain tok/s':>13}{'ngram tok/s':>13}{'speedup':>9}{'acceptance':>12}"]
    for b in bs:
        r = s[str(b)]
        lines.append(f"{b:>6}{r['plain_tok_s']:13.1f}{r['ngram_tok_s']:13.1f}{r['speedup']:8.2f}x"
                     f"{r['acceptance_rate']:12.1%}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.device is not None:  # NOTE: the device bench (pdcluster/bench/engine_device.py), e.g. --device cuda
        out = DEFAULT_DEVICE_OUT if args.out == DEFAULT_OUT else args.out
        return emit("engine", measure_device(args), out, args.json, format_device)
    if args.tensor_parallel_size is not None:  # NOTE: the TP bench (pdcluster/bench/engine_tp.py)
        out = DEFAULT_TP_OUT if args.out == DEFAULT_OUT else args.out
        return emit("engine", measure_tp(args), out, args.json, format_tp)
    r = measure(args)
    return emit("engine", r, args.out, args.json, format_table)
