"""`cpu_affinity: auto` (pdcluster/core_plan.py): which cores each worker and the router get on this node.

The real processes' cores under `pdcluster serve` on deploy/local.yaml are checked in tests/test_serve.py."""

from __future__ import annotations

from cluster.messages import Role
from pdcluster.config import ClusterConfig
from pdcluster.core_plan import plan_cores


def config(prefill: dict | None = None, decode: dict | None = None, address: str = "local") -> ClusterConfig:
    return ClusterConfig.from_data({"ray": {"address": address},
                                    "prefill": {"cpu_affinity": "auto", **(prefill or {})},
                                    "decode": {"cpu_affinity": "auto", **(decode or {})}}, "test")


def test_the_decode_worker_gets_the_last_core_and_the_router_keeps_off_it():
    cfg = config()
    plan = plan_cores(cfg, [0, 1])
    assert plan.workers == {"decode-0": (1,), "prefill-0": (0,)} and plan.router == (0,)
    assert plan.cores(cfg, Role.DECODE, 0) == (1,) and plan.cores(cfg, Role.PREFILL, 0) == (0,)
    # a worker added later, beyond the replicas the plan covers, is not pinned
    assert plan.cores(cfg, Role.PREFILL, 1) == ()
    big = plan_cores(config({"replicas": 2, "torch_threads": 2}, {"replicas": 2}), list(range(8)))
    assert big.workers == {"decode-0": (7,), "decode-1": (6,), "prefill-0": (4, 5), "prefill-1": (2, 3)}
    assert big.router == (0, 1, 2, 3, 4, 5)  # the spare cores and the prefill workers', never a decode worker's
    tp = plan_cores(config({"tensor_parallel_size": 3}), list(range(5)))  # NOTE: its ranks share its cores
    assert tp.workers == {"decode-0": (4,), "prefill-0": (1, 2, 3)} and tp.router == (0, 1, 2, 3)


def test_too_few_cores_a_joined_ray_or_listed_cores_change_the_plan():
    assert plan_cores(config({"replicas": 2}), [0, 1]).workers == {}  # 3 workers on 2 cores: none pinned
    assert plan_cores(config(address="auto"), [0, 1, 2, 3]).workers == {}  # the nodes' cores are not known here
    cfg = config({"cpu_affinity": [[3]]})
    plan = plan_cores(cfg, [0, 1, 2, 3])
    assert plan.workers == {"decode-0": (2,)} and plan.cores(cfg, Role.PREFILL, 0) == (3,)
    assert plan.router == (0, 1, 3)
    assert plan_cores(config({"cpu_affinity": None}, {"cpu_affinity": None}), [0, 1]).router == ()
