"""`pdcluster` command line: serve a cluster, talk to it over gRPC, generate locally, run the benchmarks."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import TYPE_CHECKING

from pdcluster.serve_flags import add_serve_flags, apply_flags

if TYPE_CHECKING:
    from pdcluster.config import ClusterConfig

DESCRIPTION = """Disaggregated prefill/decode LLM serving on Ray.

A cluster is a router (gRPC, OpenAI HTTP, Prometheus metrics) in front of a pool of prefill workers (they compute
prompts) and a pool of decode workers (they generate tokens); KV caches move between them over the KV transfer
layer, and Redis indexes which worker caches which prompt prefix. A YAML file in deploy/ sizes each pool
(deploy/local.yaml: everything on this machine; deploy/README.md explains every key).

Start here: `pdcluster demo` (start, chat, stop), then `pdcluster serve smollm2` and the client commands below."""

EPILOG = """examples:
  pdcluster demo                                      # start the embedded default, chat through the gRPC API, stop
  pdcluster serve smollm2                             # prints `pdcluster ready: grpc=HOST:PORT http=... metrics=...`
  PDCLUSTER_API_KEYS=sk-1 pdcluster serve ./model.gguf --prefill-replicas 2 --decode-replicas 1 --http-port 8080 \
    --host 0.0.0.0 --api-keys-env PDCLUSTER_API_KEYS  # other machines: only with keys (or allow_unauthenticated)
  PDCLUSTER_TRACING__OTLP_ENDPOINT=http://127.0.0.1:4317 pdcluster serve --config deploy/local.yaml
  pdcluster router --ray 127.0.0.1:6379 --redis 127.0.0.1:6390 --port 50052   # another router, same cluster
  pdcluster generate --addr 127.0.0.1:50051 --stream "The capital of France is"
  pdcluster chat --addr 127.0.0.1:50051
  pdcluster status --addr 127.0.0.1:50051
  pdcluster scale --addr 127.0.0.1:50051 --prefill 2 --decode 3   # resize the pools while serving
  curl -s http://127.0.0.1:8000/v1/models                # the OpenAI-compatible API of `serve`
  curl -s http://127.0.0.1:9400/metrics                  # Prometheus metrics of `serve`
  pdcluster generate --local "The capital of France is"
  pdcluster generate --local --chat --max-tokens 64 "Why is the sky blue?"
  pdcluster generate --local --json --temperature 0.7 --seed 1 "Once upon a time"
  pdcluster bench engine --json
  pdcluster bench transfer --tokens 256 --repeat 1 --json
  pdcluster bench serve --config deploy/bench-disagg.yaml --workload mixed --rates 0.2,0.4,0.6
  pdcluster bench compare                             # disaggregated vs colocated, prefix-aware vs round-robin

`pdcluster COMMAND --help` lists each command's options. Exit codes: 0 ok, 2 bad input or setup (the message names
the field to fix).
"""


# `pdcluster bench NAME`: the module that adds its options (`add_arguments`) and runs it (`run`), and its help.
BENCHES = {
    "engine": ("pdcluster.bench.engine", "our engine vs transformers: prefill/decode tok/s and the memory-bandwidth "
                                         "bound"),
    "transfer": ("pdcluster.bench.transfer", "KV transports (grpc, torch, local, nixl) vs memcpy and raw TCP: GB/s and "
                                             "layer-wise overlap"),
    "soak": ("pdcluster.bench.soak", "N streams for T minutes: requests failed, tokens lost/duplicated, KV blocks "
                                     "leaked, RSS growth"),
    "chaos": ("pdcluster.bench.chaos", "mixed gRPC/HTTP traffic while actors, Redis and a router are killed: "
                                       "invariants PASS/FAIL"),
    "serve": ("pdcluster.bench.serve", "open-loop Poisson load at one or more rates: TTFT/ITL/e2e percentiles, "
                                       "throughput, goodput, plots"),
    "path": ("pdcluster.bench.path", "what the request path adds to the engine: TTFT, ITL and tokens/s of the engine "
                                     "alone and through a cluster (HTTP, gRPC), router CPU per 1,000 tokens"),
    "compare": ("pdcluster.bench.compare", "one workload on disaggregated vs colocated (same cores) and prefix-aware "
                                           "vs round-robin routing"),
}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (with --addr)")
    # NOTE: argv is visible to every local user (`ps`): the variable or the file keep the key out of it
    g.add_argument("--api-key", default=None, help="API key, if the cluster wants one (default: $PDCLUSTER_API_KEY; "
                   "on the command line it shows in `ps`: prefer the variable or --api-key-file)")
    g.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    g.add_argument("--tls-ca", default=None, metavar="PEM", help="speak TLS, trusting this CA/self-signed certificate")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; given `argv`, a bench's options are added only for the bench it runs (its module imports
    torch and more: a client command such as `generate --addr` starts in a fraction of the time)."""
    parser = argparse.ArgumentParser(
        prog="pdcluster", description=DESCRIPTION,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    fmt = argparse.ArgumentDefaultsHelpFormatter
    serve = sub.add_parser("serve", help="start a cluster and serve gRPC, OpenAI HTTP and metrics until "
                           "SIGINT/SIGTERM", formatter_class=fmt,
                           description="Start a cluster: the YAML (--config) is the full form; PDCLUSTER_<SECTION>__"
                           "<FIELD> environment variables override any of its fields, and these flags override both.")
    add_serve_flags(serve)
    rtr = sub.add_parser("router", help="an extra router for a running cluster (shares its state through Redis)",
                         formatter_class=fmt)
    rtr.add_argument("--config", default="deploy/local.yaml", help="the cluster's deploy YAML")
    rtr.add_argument("--redis", required=True, metavar="HOST:PORT or URL",
                     help="the cluster's Redis (`serve` prints redis=HOST:PORT for its embedded one)")
    rtr.add_argument("--ray", default=None, metavar="HOST:PORT",
                     help="the cluster's Ray (`serve` prints ray=HOST:PORT for its private one); default: ray.address")
    rtr.add_argument("--port", type=int, default=None, help="override router.port (0: any free port)")
    rtr.add_argument("--http-port", type=int, default=None, help="override http.port (0: any free port)")
    rtr.add_argument("--metrics-port", type=int, default=None, help="override metrics.port (0: any free port)")
    demo = sub.add_parser("demo", help="start the embedded default, stream a few chats with timelines, stop",
                          formatter_class=fmt)
    demo.add_argument("--config", default="deploy/local.yaml", help="deploy YAML")

    gen = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=fmt)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--addr", metavar="HOST:PORT", help="a running `pdcluster serve` (gRPC)")
    where.add_argument("--local", action="store_true", help="run the engine in this process (no cluster)")
    gen.add_argument("--stream", action="store_true", help="--addr: print tokens as they arrive")
    gen.add_argument("--model", default="smollm2",
                     help="'smollm2', 'tiny', 'random:<arch>', a .gguf file or a Hugging Face directory")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt (with token ids)")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--quantization", choices=["int8"], default=None, help="--local: int8 weight-only linear layers")
    gen.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="--local: KV cache storage")
    gen.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                     help='--local: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    _add_sampling_args(gen)
    _add_client_args(gen)

    chat = sub.add_parser("chat", help="chat with a running cluster (interactive, or one turn per MESSAGE)",
                          formatter_class=fmt)
    chat.add_argument("messages", nargs="*", metavar="MESSAGE")
    chat.add_argument("--addr", required=True, metavar="HOST:PORT")
    chat.add_argument("--system", default="", help="system prompt")
    _add_sampling_args(chat)
    _add_client_args(chat)
    status = sub.add_parser("status", help="workers, load, free KV blocks and prefix hits of a running cluster")
    status.add_argument("--addr", required=True, metavar="HOST:PORT")
    _add_client_args(status)

    from pdcluster.scale import add_arguments as add_scale_args

    scale = sub.add_parser("scale", help="resize the pools of a running cluster: new workers warm up, then take "
                           "requests; surplus ones drain first", formatter_class=fmt)
    add_scale_args(scale)
    _add_client_args(scale)

    bench = sub.add_parser("bench", help="run a benchmark and save its figures")
    bsub = bench.add_subparsers(dest="bench", required=True)
    running = argv[1] if argv is not None and len(argv) > 1 and argv[0] == "bench" else None
    for name, (module, text) in BENCHES.items():
        p = bsub.add_parser(name, help=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if argv is None or name == running:
            importlib.import_module(module).add_arguments(p)
    from pdcluster.plan.cli import add_arguments as add_plan_args

    add_plan_args(sub)
    return parser


def _serve(args: argparse.Namespace, demo: bool = False) -> int:

    import pathlib

    from pdcluster import client
    from pdcluster.config import ClusterConfig, ConfigError
    from pdcluster.security import SetupError
    from pdcluster.serve import run

    path = pathlib.Path(args.config)
    if not path.exists() and not path.is_absolute():  # the default works from any directory
        path = pathlib.Path(__file__).resolve().parent.parent / path
    try:
        config = apply_flags(ClusterConfig.from_yaml(path), args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "check", False):
        print(describe_config(path, config))
        return 0
    body = None
    from cluster import logs

    # NOTE: the demo prints its own story; only warnings of the cluster would distract from it
    logs.configure("router", "WARNING" if demo else config.logging.level, config.logging.format)
    if demo:
        config.router.port = config.http.port = config.metrics.port = 0

        async def body(addr: str) -> None:
            import asyncio

            await asyncio.to_thread(client.demo, addr)
    if args.command == "router":
        config.redis.url = args.redis if "://" in args.redis else f"redis://{args.redis}/0"
        if args.ray:
            config.ray.address = args.ray
    try:
        return run(config, body, attach=args.command == "router")
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def describe_config(path: object, config: ClusterConfig) -> str:
    """`serve --check`'s answer: the file is valid, and the pools it would start (what each actor reserves)."""
    lines = [f"{path}: valid ({config.mode}, model {config.model})"]
    for role, pool in config.pools().items():
        res = pool.ray_resources()
        tp = f", tensor_parallel_size {pool.tensor_parallel_size}" if pool.tensor_parallel_size > 1 else ""
        lines.append(f"  {role}: {pool.replicas} x ({pool.device}{tp}; each reserves {res['CPU']:g} CPU, "
                     f"{res['GPU']:g} GPU" + "".join(f", {k} {v:g}" for k, v in pool.resources.items()) + ")")
    return "\n".join(lines)


def read_api_key_file(path: str) -> str:
    """The API key in `path` (its first line, stripped); ValueError naming --api-key-file when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {e}") from None
    if not key:
        raise ValueError(f"--api-key-file: {path} holds no key")
    return key


def main(argv: list[str] | None = None) -> int:
    import os

    # NOTE: before gRPC loads: its core would log every connection GOAWAY at INFO
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # NOTE: `pdcluster status ... | head`: the reader left; no traceback (Python's advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command in ("serve", "demo", "router"):
        return _serve(args, demo=args.command == "demo")
    if args.command in ("chat", "status") or (args.command == "generate" and args.addr):
        from pdcluster import client

        if args.api_key_file:
            try:
                args.api_key = read_api_key_file(args.api_key_file)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2

        return {"chat": client.chat, "status": client.status, "generate": client.generate}[args.command](args)
    if args.command == "generate":
        from pdcluster.local_generate import generate

        return generate(args)
    if args.command == "scale":
        from pdcluster.scale import run as run_scale

        return run_scale(args)
    if args.command in ("bench", "plan"):
        try:
            if args.command == "bench":
                return int(importlib.import_module(BENCHES[args.bench][0]).run(args))
            from pdcluster.plan.cli import run as run_plan

            return run_plan(args)
        except (FileNotFoundError, ValueError) as e:  # bad input (a missing file, a rate <= 0, a bad YAML)
            print(f"pdcluster {args.command}: error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":  # NOTE: `python -m pdcluster.cli ...` ran nothing without it (`-m pdcluster` did)
    raise SystemExit(main())
