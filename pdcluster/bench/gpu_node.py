"""The one-node cluster gpu-check's cluster step measures (pdcluster/bench/gpu_cluster.py, gpu_load.py): the config
derived from deploy/gpu-one-node.yaml, fresh prompts, requests through the router with their timelines, one engine in
the measuring process, and where each part's figures are saved."""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from pdcluster.bench import cluster_proc
from pdcluster.config import ClusterConfig

YAML = "deploy/gpu-one-node.yaml"
CPU_KV_BLOCKS = 1024


class NeedsCuda(Exception):
    """A part that measures something only a CUDA GPU has."""


def one_node(device: str, model: str, dtype: str = "auto", mode: str = "disaggregated",
             env_vars: dict[str, str] | None = None) -> ClusterConfig:
    """deploy/gpu-one-node.yaml for a measurement: `model`, every prompt through the prefill pool (skip-prefill and
    SLO placement off), free ports; on the CPU the pools computed there; `colocated`: one worker with the GPU."""
    data = cluster_proc.load(YAML).model_dump()
    data["model"] = model
    data["router"].update(skip_prefill_max_uncached_tokens=0, slo_itl_ms=None)
    for name in ("prefill", "decode"):
        pool = data[name]
        pool.update(dtype=dtype, env_vars={**pool["env_vars"], **(env_vars or {})})
        if device == "cpu":
            pool.update(device="cpu", num_gpus=0, num_cpus=1, gpu_memory_utilization=None,
                        num_kv_blocks=CPU_KV_BLOCKS, max_num_batched_tokens=2048)
    if mode == "colocated":
        # NOTE: the strongest single-GPU baseline: one engine with the whole GPU, as vLLM would run it
        whole = {"num_gpus": 1, "gpu_memory_utilization": 0.9} if device != "cpu" else {"num_cpus": 2,
                                                                                       "torch_threads": 2}
        data.update(mode="colocated", colocated={**data["decode"], "replicas": 1, **whole})
    return ClusterConfig.from_data(data, f"{YAML} ({mode}, {model}, {device})")


def fresh_prompts(n: int, seed: int, vocab: int, lo: int = 24, hi: int = 200) -> list[list[int]]:
    """`n` prompts of random token ids no cache holds (a fresh seed per run of the check)."""
    rng = random.Random(seed)
    return [[rng.randrange(256, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def generate(addr: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt through the router's Generate, one after another, greedy, exactly `max_tokens` tokens: the
    answer's ids and the request's timeline."""
    import grpc

    from router.v1 import inference_pb2 as pb
    from router.v1 import inference_pb2_grpc as pb_grpc

    out = []
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for prompt in prompts:
            req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            resp = await stub.Generate(req, timeout=300)
            tl = resp.timeline
            out.append({"token_ids": list(resp.token_ids), "e2e_ms": (time.perf_counter() - t0) * 1e3,
                        "prefill_worker": tl.prefill_worker, "decode_worker": tl.decode_worker,
                        "prefill_skipped": tl.prefill_skipped, "placement": tl.placement, "prefill_ms": tl.prefill_ms,
                        "transfer_ms": tl.transfer_ms, "first_token_ms": tl.first_token_ms, "decode_ms": tl.decode_ms,
                        "kv_bytes_sent": tl.kv_bytes_sent})
    return out


def engine_of(model: str, device: str, dtype: str) -> Any:
    """One engine in this process, as a pool worker of the cluster check runs it (1 torch thread on the CPU)."""
    import engine

    kw: dict[str, Any] = {"num_blocks": CPU_KV_BLOCKS, "num_threads": 1} if device == "cpu" else {
        "kv_cache_memory_gb": 4.0}
    return engine.LLM(model, device=device, dtype=dtype, max_model_len=8192, max_num_batched_tokens=8192, **kw)


def save(out_dir: str, part: str, result: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"cluster_{part}.json"), "w") as f:
        json.dump(result, f, indent=2)
