"""`pdcluster scale --addr ROUTER --prefill N --decode M`: resize the pools of a serving cluster.

The router that started the workers (`pdcluster serve`) starts the missing ones (they register, warm up, then take
requests) and drains the surplus (no new requests; running ones finish or move), through its admin method
`Scale` (behind the API key). The command returns once the pools have the sizes asked for.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc

SCALE_TIMEOUT_S = 900.0  # starting a worker loads its model; draining waits for running requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router of a running `pdcluster serve`")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers wanted (default: as is)")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="decode workers wanted (the colocated pool in mode colocated; default: as is)")
    p.add_argument("--timeout", type=float, default=SCALE_TIMEOUT_S, help="seconds to wait for the pools")


def run(args: Any) -> int:
    from pdcluster import client
    from router.v1 import inference_pb2 as pb

    if args.prefill is None and args.decode is None:
        print("error: --prefill or --decode: say which pool to resize", file=sys.stderr)
        return 2
    for name in ("prefill", "decode"):
        value = getattr(args, name)
        if value is not None and value < 0:
            print(f"error: --{name}: must be >= 0, got {value}", file=sys.stderr)
            return 2
    request = pb.ScaleRequest(prefill=args.prefill, decode=args.decode)
    started = time.monotonic()
    try:
        resp = client.stub_from_args(args).Scale(request, timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(f"pools: {resp.prefill} prefill, {resp.decode} decode ({time.monotonic() - started:.1f} s); "
          f"added: {', '.join(resp.added) or 'none'}; removed: {', '.join(resp.removed) or 'none'}")
    return 0
