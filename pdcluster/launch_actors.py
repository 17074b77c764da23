"""How one worker actor is made: its `WorkerSpec` from the config, its process's environment, the Ray options it
starts with (a TP worker: its placement group), and the checks that Ray has room for the pools (pdcluster/launch.py
starts, adopts and stops them)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from cluster import cores
from cluster.messages import Role
from cluster.redis_client import RedisAuth
from cluster.worker_spec import WorkerSpec
from kv_transfer.tls import KVTls
from pdcluster import security
from pdcluster.config import ClusterConfig
from pdcluster.config_pool import PoolConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLACEMENT_TIMEOUT_S = 120.0  # how long a TP worker's placement group may wait for a node with room for all its ranks


def worker_env(torch_threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a worker process: our code importable, one thread pool of the configured size."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # NOTE: PASSIVE: idle OpenMP threads sleep instead of spinning; two busy-waiting pools on 2 cores thrash.
    # NOTE: every decode step gathers batch x context x KV bytes per layer into fresh tensors of several MB. Above
    # glibc's mmap threshold (128 KiB until a big chunk has been freed) each one is a fresh mmap, page-faulted in
    # and unmapped again; the largest fixed threshold (32 MiB) and a high trim threshold keep them on the heap
    # (see pdcluster/plan/README.md, "What the profiling found in the engine").
    faults = {k: v for k, v in os.environ.items() if k.startswith("PDC_FAULT_")}  # NOTE: tests' fault injection
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": str(torch_threads), "OMP_WAIT_POLICY": "PASSIVE",
            "RAY_USAGE_STATS_ENABLED": "0", "GRPC_VERBOSITY": "ERROR",
            "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30), **(extra or {}), **faults}


def worker_spec(cfg: ClusterConfig, role: Role, index: int, pool: PoolConfig, number: int, *, redis_url: str | None,
                redis_auth: RedisAuth, cluster_token: str, kv_tls: KVTls | None,
                cpus: tuple[int, ...]) -> WorkerSpec:
    """The spec of worker `{role}-{index}`, the `number`-th actor this cluster started (its metrics port)."""
    pools = frozenset((p.device, p.tensor_parallel_size) for p in cfg.pools().values())  # NOTE: nixl may go grpc
    transfer = dataclasses.replace(cfg.transfer.transfer_config(pool.device, pools),
                                   cluster_token=cluster_token, tls=kv_tls)
    # NOTE: the router's SLOs bound the engine's steps: prompt chunks beside a decode batch stay within the ITL
    # target, and shortest_first promotes a prompt nearing the TTFT target (engine/step_budget.py)
    engine = dataclasses.replace(pool.engine_config(cfg.lora), step_target_ms=cfg.router.slo_itl_ms,
                                 ttft_target_ms=cfg.router.slo_ttft_ms)
    spec = WorkerSpec(f"{role}-{index}", role, cfg.model, engine, transfer, redis_url=redis_url,
                      key_prefix=cfg.redis.key_prefix, kv_host=cfg.transfer.host, log_level=cfg.logging.level,
                      log_format=cfg.logging.format, redis_auth=redis_auth, cpus=cpus, nice=pool.nice,
                      served_model_name=cfg.served_model_name,
                      metrics_host=cfg.metrics.worker_host, tracing=cfg.tracing.settings(),
                      metrics_port=(cfg.metrics.worker_port and cfg.metrics.worker_port + number)
                      if cfg.metrics.workers else None, lora_modules=tuple(cfg.lora.modules.items()))
    if pool.device == "cpu" and any(p.lend_idle_cores for p in cfg.pools().values()):
        # NOTE: every CPU worker of the cluster marks busy/idle on its node; only lending pools borrow
        spec = dataclasses.replace(spec, cores_group=cores.group_name(cfg.redis.key_prefix, cluster_token),
                                   lend_cores=pool.lend_idle_cores, lend_min_tokens=pool.lend_min_prompt_tokens)
    return spec


def start_actor(cfg: ClusterConfig, pool: PoolConfig, spec: WorkerSpec) -> Any:
    """Start the named, detached Ray actor of `spec` (it loads the model; `info()` answers once it is ready)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from decode_workers.actor import DecodeActor
    from prefill_workers.actor import PrefillActor

    cls = PrefillActor if spec.role is Role.PREFILL else DecodeActor
    # NOTE: as Ray Serve places replicas: a pool's workers on as many nodes as can take them, so losing a node loses
    # as few of them as possible
    strategy: Any = "SPREAD"
    if pool.tensor_parallel_size > 1:
        # NOTE: a TP n worker is n actors of one placement group: this one is rank 0 (bundle 0), and it starts ranks
        # 1 .. n-1 in the other bundles (cluster/tp_ranks.py); each rank reserves its own CPUs and GPU
        pg = place_ranks(cfg, pool, spec.name)
        spec = dataclasses.replace(spec, placement_group=pg.id.hex())
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    return cls.options(  # type: ignore[union-attr]
        name=spec.name, namespace=cfg.ray.namespace, num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
        resources=dict(pool.resources) or None, max_restarts=pool.max_restarts,
        # NOTE: detached: a worker outlives the router that started it (a crash, `kill -9`, keep_workers)
        lifetime="detached", scheduling_strategy=strategy,
        runtime_env={"env_vars": worker_env(pool.torch_threads, pool.env_vars)}).remote(spec)


def placement_name(cfg: ClusterConfig, worker: str) -> str:
    """The name of worker `worker`'s placement group (TP > 1): the namespace in it, as a driver's own may differ."""
    return f"{cfg.ray.namespace}/{worker}-tp"


def place_ranks(cfg: ClusterConfig, pool: PoolConfig, worker: str) -> Any:
    """A ready placement group for one TP worker of `pool`: a bundle per rank, all on one node (STRICT_PACK),
    detached as the worker is; Overloaded when Ray finds no node for it within PLACEMENT_TIMEOUT_S."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from router.errors import Overloaded

    remove_placement(cfg, worker)  # NOTE: a leftover of a worker killed without it (a replaced or crashed one)
    rank = {k: v for k, v in {"CPU": pool.num_cpus, "GPU": pool.num_gpus}.items() if v > 0}
    # NOTE: the pool's custom resources mark nodes (e.g. {prefill_node: 1}): once per worker, on rank 0's bundle
    bundles = [{**rank, **pool.resources}] + [dict(rank) for _ in range(pool.tensor_parallel_size - 1)]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=placement_name(cfg, worker), lifetime="detached")
    if not pg.wait(PLACEMENT_TIMEOUT_S):
        remove_placement_group(pg)
        raise Overloaded(f"the Ray cluster has no node with room for worker {worker}: its {pool.tensor_parallel_size} "
                         f"ranks need {', '.join(f'{k} {v:g}' for k, v in rank.items())} each on one node (waited "
                         f"{PLACEMENT_TIMEOUT_S:.0f} s); add nodes of its type or lower the other pool")
    return pg


def remove_placement(cfg: ClusterConfig, worker: str) -> None:
    """Remove worker `worker`'s placement group, if it has one (a TP worker stopped for good; its ranks go too).
    A worker of a TP 1 pool has none: no lookup in Ray's GCS for it."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    pool = cfg.pools().get(Role(worker.rsplit("-", 1)[0]))
    if pool is None or pool.tensor_parallel_size == 1:
        return
    try:
        remove_placement_group(get_placement_group(placement_name(cfg, worker)))
    except ValueError:  # NOTE: none: TP 1, or already removed
        pass


def check_resources(config: ClusterConfig, available: dict[str, float]) -> None:
    """Fail early, naming the pools, when Ray cannot place every actor (it would wait forever)."""
    need: dict[str, float] = {}
    parts: dict[str, list[str]] = {}
    for role, pool in config.pools().items():
        for key, per in pool.ray_resources().items():  # NOTE: per worker: all ranks of its TP group
            if per > 0:
                need[key] = need.get(key, 0.0) + per * pool.replicas
                parts.setdefault(key, []).append(f"{role}: {pool.replicas} x {per:g}")
    for key, total in need.items():
        if total > available.get(key, 0.0) + 1e-9:
            raise security.SetupError(
                f"the pools need {total:g} {key} ({', '.join(parts[key])}) but the Ray cluster has "
                f"{available.get(key, 0.0):g}: lower the replicas or the per-rank {key} of a pool, or give Ray "
                "more (ray.num_cpus)")


def check_room(role: Role, pool: PoolConfig, free: dict[str, float]) -> None:
    """RESOURCE_EXHAUSTED when no node has room for one more actor of `pool` (Ray would wait for one forever)."""
    from router.errors import Overloaded

    need = pool.ray_resources()  # NOTE: a TP n worker reserves n ranks' CPUs and GPUs (its placement group)
    short = {k: v for k, v in need.items() if v > 0 and free.get(k, 0.0) + 1e-9 < v}
    if short:
        raise Overloaded(f"the Ray cluster has no room for another {role} worker: it needs "
                         + ", ".join(f"{k} {v:g} ({free.get(k, 0.0):g} free)" for k, v in short.items())
                         + "; add nodes of its type or lower the other pool")
