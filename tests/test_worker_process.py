"""A pool's process settings reach the worker's real process: cores, CPU priority (nice), torch threads, env.

The cluster is deploy/bench-disagg.yaml with each pool's keys changed to values no default gives; after a request
has run through both workers (so torch's OpenMP pool and the engine loop exist), every thread of each actor's
process is read from /proc, from outside the process.
"""

from __future__ import annotations

import os

import pytest
import ray

from pdcluster.config import ClusterConfig
from router.v1 import inference_pb2 as pb
from tests.helpers import start_test_cluster

pytestmark = pytest.mark.slow
NAMESPACE = "test-worker-process"


def _thread_nices(pid: int) -> set[int]:
    """The nice value of every thread of process `pid` (/proc/PID/task/TID/stat, field 19)."""
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # a thread that just ended
        nices.add(int(stat.rsplit(")", 1)[1].split()[16]))  # fields after "(comm)": state is field 3
    return nices


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return dict(pairs)  # type: ignore[arg-type]


def test_workers_run_with_their_pools_nice_threads_cores_and_env(ray_session):
    cores = sorted(os.sched_getaffinity(0))
    last = cores[-1]

    def edit(config: ClusterConfig) -> None:
        config.prefill.nice, config.prefill.torch_threads, config.prefill.cpu_affinity = 7, 2, [cores]
        config.decode.nice, config.decode.torch_threads, config.decode.cpu_affinity = 3, 1, [[last]]
        config.decode.env_vars = {"GOMP_SPINCOUNT": "0"}
        config.prefill.num_kv_blocks = config.decode.num_kv_blocks = 256
        config.decode.lend_min_prompt_tokens = 0  # NOTE: its decode steps borrow too (by default only long prompts)

    cluster, server = start_test_cluster("deploy/bench-disagg.yaml", NAMESPACE, edit=edit, slo_itl_ms=None)
    try:
        prompt = list(range(1000, 1100))  # NOTE: unique and uncached: it crosses the prefill -> decode handoff
        r = server.stub().Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True)), timeout=300)
        assert r.usage.completion_tokens == 8 and not r.timeline.prefill_skipped
        want = {"prefill-0": (7, 2, cores), "decode-0": (3, 1, [last])}
        for name, (nice, threads, cpus) in want.items():
            info = ray.get(ray.get_actor(name, namespace=NAMESPACE).process.remote(), timeout=60)
            pid = int(info["pid"])
            assert info["torch_threads"] == threads, name
            assert sorted(os.sched_getaffinity(pid)) == cpus, name
            assert _thread_nices(pid) == {nice}, name  # every thread, the engine's and OpenMP's included
            env = _environ(pid)
            assert env["OMP_NUM_THREADS"] == str(threads) and env["OMP_WAIT_POLICY"] == "PASSIVE", name
            assert env.get("GOMP_SPINCOUNT") == ("0" if name.startswith("decode") else None), name
        # NOTE: the YAML's lend_idle_cores and the pool's lend_min_prompt_tokens reach the workers: the decode worker
        # stepped on the prefill worker's other cores once the prefill worker was idle, and is back on its own one
        decode_info = ray.get(ray.get_actor("decode-0", namespace=NAMESPACE).process.remote(), timeout=60)
        assert cluster.config.decode.lend_idle_cores and (decode_info["lent_steps"] > 0 or len(cores) == 1)
    finally:
        server.close()
        cluster.stop()
