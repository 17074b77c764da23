"""The H200 profile of one Llama-3.1-8B worker, calibrated on what the lent H200 measured (BENCHMARKS.md, "Engine on a
GPU", 2026-11-26, code f843769: `random:llama-3.1-8b` in bfloat16, one engine, CUDA graphs).

Measured there, and what each fixes in the step model t = c0 + c_tok·max(T, knee) + c_seq·S + c_dec·K + c_pre·P:
- the host's share of a batch-1 decode step, ~0.4 ms (profiler: a 4.47 ms graph replay, 4.32 ms of kernels) -> c0;
- decode at 512 tokens of context, batch 1: 185.8 tok/s, batch 64: 7,480 tok/s -> c_dec (their difference per
  sequence, less c_seq) and c0 + c_tok·knee (the weight-read floor; both batches lie below the knee);
- prefill of one 2,048-token prompt: 43,423 tok/s -> c_tok (then knee from the floor);
- KV between two processes on one GPU through NIXL: 2.3 GB/s (second round; 6.7 the first), a device copy 285 GB/s.
ESTIMATED (the roofline of pdcluster/plan/hardware.py; nothing measured them): c_seq (the logits row of a sampled
sequence) and c_pre_pair (prefill attention), the transfer's fixed cost, and anything past one GPU.

    python -m pdcluster.plan.h200 [--transfer-gb-s 2.3] [--out pdcluster/plan/h200-llama-3.1-8b.json]

writes the profile (the shipped file is this with the measured 2.3 GB/s; `--profile h200-measured` loads it).
"""

from __future__ import annotations

import argparse
import sys

from pdcluster.plan.hardware import TRANSFER_LATENCY_S, roofline_profile
from pdcluster.plan.profile import Profile, StepModel, TransferModel, describe, prefill_pairs

HOST_S = 0.4e-3  # the host's part of a batch-1 decode step (engine profile on the H200)
DECODE_CONTEXT = 512
DECODE_B1_TOK_S = 185.8
DECODE_B64_TOK_S = 7480.0
PREFILL_TOKENS = 2048
PREFILL_TOK_S = 43423.0
NIXL_ONE_GPU_GB_S = 2.3  # the second round of tests/test_kv_nixl_gpu.py on the H200 (most likely via the host)
DEVICE_COPY_GB_S = 285.0  # a device-to-device copy of the same 94 MB in that test


def measured_profile(transfer_gb_s: float = NIXL_ONE_GPU_GB_S) -> Profile:
    """The step model solved from the measured figures above; the KV transfer at `transfer_gb_s`."""
    roof = roofline_profile("h200", "llama-3.1-8b")
    c_seq, c_pre = roof.step.c_seq_s, roof.step.c_pre_pair_s
    b1, b64 = 1 / DECODE_B1_TOK_S, 64 / DECODE_B64_TOK_S  # seconds per step
    # NOTE: below the knee, b64 - b1 = 63·c_seq + c_dec·(64 - 1)·context
    c_dec = ((b64 - b1) / 63 - c_seq) / DECODE_CONTEXT
    floor = b1 - c_seq - c_dec * DECODE_CONTEXT  # c0 + c_tok·knee
    prefill = PREFILL_TOKENS / PREFILL_TOK_S
    c_tok = (prefill - HOST_S - c_seq - c_pre * prefill_pairs(PREFILL_TOKENS, 0)) / PREFILL_TOKENS
    step = StepModel(c0_s=HOST_S, c_tok_s=c_tok, knee_tokens=(floor - HOST_S) / c_tok, c_seq_s=c_seq,
                     c_dec_key_s=c_dec, c_pre_pair_s=c_pre, decode_attention="sum")
    transfer = TransferModel(bandwidth_gb_s=transfer_gb_s, latency_s=TRANSFER_LATENCY_S, num_layers=32)
    kind = "measured" if transfer_gb_s == NIXL_ONE_GPU_GB_S else "PREDICTED (not measured)"
    return Profile(
        hardware="H200-SXM (measured)", model="Llama-3.1-8B", threads=1, gpus_per_worker=1, estimated=False,
        device="cuda", source="BENCHMARKS.md 'Engine on a GPU' (H200, 2026-11-26, f843769), pdcluster/plan/h200.py",
        step=step, transfer=transfer, kv_bytes_per_token=roof.kv_bytes_per_token,
        notes=[f"measured: decode {DECODE_B1_TOK_S:g} tok/s at batch 1 and {DECODE_B64_TOK_S:g} at 64 (context "
               f"{DECODE_CONTEXT}), prefill {PREFILL_TOK_S:g} tok/s ({PREFILL_TOKENS} tokens), host "
               f"{HOST_S * 1e3:g} ms a step", "ESTIMATED (roofline): c_seq, c_pre_pair, the transfer's fixed cost",
               f"KV transfer {transfer_gb_s:g} GB/s: {kind} (NIXL between two processes on one H200: "
               f"{NIXL_ONE_GPU_GB_S:g} GB/s; a device copy {DEVICE_COPY_GB_S:g} GB/s)"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.plan.h200", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfer-gb-s", type=float, default=NIXL_ONE_GPU_GB_S)
    p.add_argument("--out", default=None, help="write the profile JSON here (default: print it)")
    args = p.parse_args(argv)
    prof = measured_profile(args.transfer_gb_s)
    if args.out:
        prof.save(args.out)
    print(describe(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
