"""Cores of this node for `cpu_affinity: auto`: each worker on cores of its own, the router off the decode cores.

On a machine where the workers, the router and the clients share a few cores, the scheduler can preempt a decode
worker's engine thread whenever the router or a client wakes up (once per token of a stream). Keeping them apart
mattered while other jobs loaded this 2-core machine; on the quiet machine `pdcluster bench path` showed no steady
difference either way (BENCHMARKS.md, the request path, session 11). vLLM's CPU backend binds its workers' threads
the same way by default (`VLLM_CPU_OMP_THREADS_BIND=auto`) and keeps a core for its API server.

The plan (`plan_cores`), for a private Ray (`ray.address: local`: every worker runs on this node):
1. the pools that say `auto` take cores from the top of this process's cores down, `torch_threads` per rank each
   (a TP worker's rank actors share their worker's cores: cluster/tp_ranks.py): decode
   (and colocated) workers first (their steps set every stream's inter-token gap), then prefill workers; cores
   a pool lists itself are left to it;
2. when the `auto` workers need more cores than are left, none of them is pinned (sharing cores by a plan would
   be worse than the scheduler's balancing) and the start says so;
3. the router's process (`pdcluster serve`) keeps to the cores no decode worker has (with the prefill workers,
   whose work comes in bursts), set before Ray starts so Ray's own processes keep off them too; when no such
   core is left it is not pinned.
A worker added later (`pdcluster scale`, the autoscaler) beyond a pool's replicas is not pinned; a restarted one
keeps its cores. On a Ray cluster that this process joins, `auto` pins nothing (the nodes' cores are not known).
Two clusters started on one machine both plan from the same cores: give one of them explicit lists (or null).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.messages import Role

if TYPE_CHECKING:
    from pdcluster.config import ClusterConfig

log = logging.getLogger(__name__)
AUTO = "auto"


@dataclass
class CorePlan:
    """Cores per worker name (`{role}-{i}`) for the `auto` pools, and the router's (empty: not pinned)."""

    workers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    router: tuple[int, ...] = ()

    def cores(self, config: ClusterConfig, role: Role, index: int) -> tuple[int, ...]:
        """Worker `index` of `role`'s cores: its pool's own list, its `auto` share, or () (not pinned)."""
        pool = config.pools()[role]
        if pool.cpu_affinity == AUTO:
            return self.workers.get(f"{role}-{index}", ())
        return pool.cpus(index)


def plan_cores(config: ClusterConfig, available: list[int] | None = None) -> CorePlan:
    """The plan for `config`'s pools on this node (`available`: this process's cores by default)."""
    auto = {role: pool for role, pool in config.pools().items() if pool.cpu_affinity == AUTO and pool.replicas}
    if not auto:
        return CorePlan()
    if config.ray.address != "local":
        log.info("cpu_affinity auto: the workers run on the nodes of a Ray cluster this process joined; not pinned")
        return CorePlan()
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    listed = {c for pool in config.pools().values() if isinstance(pool.cpu_affinity, list)
              for entry in pool.cpu_affinity for c in entry}
    free = [c for c in cores if c not in listed]
    per = {role: pool.torch_threads * pool.tensor_parallel_size for role, pool in auto.items()}
    need = sum(pool.replicas * per[role] for role, pool in auto.items())
    if need > len(free):
        log.warning("cpu_affinity auto: the workers need %d cores of their own and %d are free (%s): not pinned",
                    need, len(free), free)
        return CorePlan()
    plan = CorePlan()
    order = sorted(auto, key=lambda role: not role.decodes)  # NOTE: decode (and colocated) workers first
    for role in order:
        for i in range(auto[role].replicas):
            plan.workers[f"{role}-{i}"] = tuple(sorted(free[-per[role]:]))
            del free[-per[role]:]
    decode_cores = {c for role in order if role.decodes for i in range(auto[role].replicas)
                    for c in plan.workers[f"{role}-{i}"]}
    plan.router = tuple(c for c in cores if c not in decode_cores)
    return plan
