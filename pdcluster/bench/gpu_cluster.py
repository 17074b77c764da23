"""gpu-check.sh's `cluster` step (issue 38): the whole cluster (`pdcluster serve`: router, Ray pools, embedded Redis,
the KV handoff) on one GPU node from deploy/gpu-one-node.yaml, measured as a user meets it.

    python -m pdcluster.bench.gpu_cluster --out-dir DIR [--device cuda|cpu] [--parts text,handoff,serve,mps]

Each part runs in a child process (its own session) with its own time limit: a part that hangs is killed with
everything it started, and the next one runs. Each saves DIR/cluster_<part>.json as it ends (`ok`, its figures,
or why not):
  text     (a) greedy text through the cluster on 8 fresh prompts x 64 tokens, each through the prefill pool and
           the KV handoff (the router's skip-prefill and SLO placement off), against one engine in this process on
           the same device; random:smollm2-135m in float32 (--text-model)
  handoff  (b) 2,048-token prompts of --model: KV bytes, the prefill's time, the handoff's tail after the first
           token, a device-to-device copy of the same bytes here, the UCX lanes the workers' logs name (needs CUDA)
  serve    (c) `bench serve`'s sweep on --model, disaggregated (the YAML as shipped) and colocated (one worker, the
           whole GPU), with the engine's own prefill time and decode step beside it (pdcluster/bench/gpu_load.py)
  mps      (d) the disaggregated sweep again under CUDA MPS, each worker half the SMs (needs CUDA and MPS)
On the CPU (--device cpu, scripts/gpu-rehearse.sh) the same code runs with small models and sweeps; the parts that
need CUDA say so. Exit status 0 when no part failed (a part that cannot run on this device is not a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from pdcluster.bench import cluster_proc, gpu_load
from pdcluster.bench.gpu_node import NeedsCuda, engine_of, fresh_prompts, generate, one_node, save
from pdcluster.bench.report import log

# NOTE: text's first cluster on a fresh machine also compiles the Triton kernels (both workers and the engine)
LIMITS_S = {"text": 130, "handoff": 80, "serve": 240, "mps": 100}  # 550 s: gpu-check gives the step 560
NEEDS_CUDA = ("handoff", "mps")


def part_text(args: argparse.Namespace) -> dict[str, Any]:
    """(a): the cluster's greedy ids on fresh prompts against one engine's, prompt by prompt."""
    from engine.sampling_params import SamplingParams

    cfg = one_node(args.device, args.text_model, "float32")
    prompts = fresh_prompts(args.text_prompts, args.seed, args.vocab)
    with cluster_proc.serving(cfg, "text") as addr:
        got = asyncio.run(generate(addr, prompts, args.text_tokens))
    llm = engine_of(args.text_model, args.device, "float32")
    greedy = SamplingParams(max_tokens=args.text_tokens, temperature=0.0, ignore_eos=True)
    want = [llm.generate([p], greedy)[0].token_ids for p in prompts]  # NOTE: one at a time, as the cluster ran them
    diffs = [next((i for i, (a, b) in enumerate(zip(g["token_ids"], w)) if a != b), min(len(g["token_ids"]), len(w)))
             for g, w in zip(got, want)]
    same = [g["token_ids"] == list(w) for g, w in zip(got, want)]
    handoffs = sum(bool(g["prefill_worker"]) and not g["prefill_skipped"] and g["kv_bytes_sent"] > 0 for g in got)
    return {"ok": all(same) and handoffs == len(prompts), "model": args.text_model, "dtype": "float32",
            "prompts": len(prompts), "tokens": args.text_tokens, "identical": sum(same), "handoffs": handoffs,
            "first_difference": [None if s else d for s, d in zip(same, diffs)],
            "prompt_lens": [len(p) for p in prompts], "requests": [{k: v for k, v in g.items() if k != "token_ids"}
                                                                  for g in got]}


def run_part(part: str, args: argparse.Namespace) -> int:
    """Run one part here; save its JSON (figures, or the error); 0 unless it failed."""
    fn = {"text": part_text, "handoff": gpu_load.part_handoff, "serve": gpu_load.part_serve,
          "mps": gpu_load.part_mps}[part]
    t0 = time.monotonic()
    try:
        if part in NEEDS_CUDA and args.device != "cuda":
            raise NeedsCuda(f"{part}: needs a CUDA GPU (--device {args.device})")
        result = fn(args)
    except NeedsCuda as e:
        result = {"ok": None, "skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - saved with its traceback: the check goes on with the next part
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result.update(part=part, device=args.device, seconds=round(time.monotonic() - t0, 1))
    save(args.out_dir, part, result)
    log("gpu-cluster", f"{part}: " + ("ok" if result["ok"] else result.get("skipped") or result.get("error", "FAILED")))
    return 1 if result["ok"] is False else 0


def _child(part: str, argv: list[str], limit_s: float, out_dir: str) -> int:
    """`part` in a child process of its own session; killed with all it started after `limit_s`."""
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.bench.gpu_cluster", "--only", part, *argv],
                            start_new_session=True)
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        save(out_dir, part, {"ok": False, "part": part, "error": f"timed out after {limit_s:.0f} s (killed)"})
        return 124


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.gpu_cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--parts", default="text,handoff,serve,mps")
    p.add_argument("--only", choices=sorted(LIMITS_S), help=argparse.SUPPRESS)  # a part, in the child process
    p.add_argument("--limit-pct", type=float, default=100.0, help="scale every part's time limit")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="fresh prompts (default: the clock)")
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--text-model", default="random:smollm2-135m")
    p.add_argument("--text-prompts", type=int, default=8)
    p.add_argument("--text-tokens", type=int, default=64)
    gpu_load.add_arguments(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.only:
        return run_part(args.only, args)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(LIMITS_S))
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {sorted(LIMITS_S)}")
    rest = [a for i, a in enumerate(argv) if not a.startswith("--parts") and (i == 0 or argv[i - 1] != "--parts")]
    rest += ["--device", args.device, "--seed", str(args.seed)]  # NOTE: every part draws the same prompts
    failed = 0
    for part in parts:
        if part in NEEDS_CUDA and args.device != "cuda":  # NOTE: it says why here, no child process to start
            failed += run_part(part, args) != 0
            continue
        log("gpu-cluster", f"{part} (limit {LIMITS_S[part] * args.limit_pct / 100:.0f} s)")
        failed += _child(part, rest, LIMITS_S[part] * args.limit_pct / 100, args.out_dir) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
