"""`pdcluster generate --local`: no cluster, the engine in this process (pdcluster/cli.py parses the flags)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def generate(args: argparse.Namespace) -> int:
    """`pdcluster generate --local`: the prompts through one engine in this process, its text (or JSON) printed."""
    from engine import LLM, EngineError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        print(f"loading {args.model} ...", file=sys.stderr)
        llm = LLM(args.model, progress=True, num_threads=args.threads, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config)
        print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        t0 = time.perf_counter()
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            results = llm.generate(args.prompts, params)
        elapsed = time.perf_counter() - t0
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, r in zip(args.prompts, results):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                              "prompt_tokens": len(r.prompt_token_ids), "finish_reason": r.finish_reason,
                              "cached_prompt_tokens": r.cached_prompt_tokens}))
        else:
            if len(args.prompts) > 1:
                print(f"--- {prompt}")
            print(r.text)
    n = sum(len(r.token_ids) for r in results)
    print(f"[{n} tokens in {elapsed:.2f} s]", file=sys.stderr)
    return 0
