"""`pdcluster` command line: generate text locally and run the project's benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
import time

EPILOG = """examples:
  pdcluster generate --local "The capital of France is"
  pdcluster generate --local --chat --max-tokens 64 "Why is the sky blue?"
  pdcluster generate --local --json --temperature 0.7 --seed 1 "Once upon a time"
  pdcluster bench engine --json
  pdcluster bench transfer --tokens 256 --repeat 1 --json
"""


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcluster", description="Disaggregated prefill/decode LLM serving.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--local", action="store_true", required=True,
                     help="run the engine in this process (prefill and decode colocated)")
    gen.add_argument("--model", default="smollm2", help="'smollm2', 'tiny', a .gguf file or a Hugging Face directory")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt (with token ids)")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    _add_sampling_args(gen)

    bench = sub.add_parser("bench", help="run a benchmark and save its figures")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from pdcluster.bench.engine import add_arguments as add_engine_bench_args

    add_engine_bench_args(bsub.add_parser(
        "engine", help="our engine vs transformers: prefill/decode tok/s and the memory-bandwidth bound",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    from pdcluster.bench.transfer import add_arguments as add_transfer_bench_args

    add_transfer_bench_args(bsub.add_parser(
        "transfer", help="KV transports (grpc, torch, local) vs memcpy and raw TCP: GB/s and layer-wise overlap",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, EngineError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        print(f"loading {args.model} ...", file=sys.stderr)
        llm = LLM(args.model, progress=True, num_threads=args.threads)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench" and args.bench == "engine":
        from pdcluster.bench.engine import run

        return run(args)
    if args.command == "bench" and args.bench == "transfer":
        from pdcluster.bench.transfer import run as run_transfer

        return run_transfer(args)
    return 2
