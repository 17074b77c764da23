"""Tensor-parallel pools through `pdcluster serve`: a TP group is one worker to the router, the index and the KV
hand-off (deploy/local-tp.yaml, the shipped TP cluster, on the tiny random model, CPU, gloo).

Three clusters, one per layout (module-scoped, parametrized): prefill TP 2 → decode TP 1, prefill TP 1 → two decode
workers of TP 2, and prefill TP 2 → decode TP 2, all over deploy/local-tp.yaml's nixl (the sender gathers the heads a
decode rank holds otherwise than any prefill rank: kv_transfer/transports/nixl_reshard.py). Every fresh prompt
crosses the prefill → decode hand-off (no SLO keeps it on the decode worker), and the tokens must equal one TP 1
engine's (the tiny model's logits are far apart: float32 sums in another order pick the same greedy token). In the
second layout a follower rank of the decode worker holding the streams is SIGKILLed mid-stream: the worker ends (a TP
group is one worker), its streams finish on the other one with no token lost or repeated, and Ray restarts it as a
fresh group.
The followers are Ray actors of their worker's placement group (one node), and a stopped cluster leaves no placement
group behind. Every layout serves a LoRA adapter (each rank holding its share): its tokens across the hand-off equal
one TP 1 engine's with the adapter.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.v1 import inference_pb2 as pb
from tests.helpers import (
    generate_ids,
    greedy,
    greedy_reference,
    make_engine,
    start_test_cluster,
    stream_greedy,
    wait_for,
)
from tests.lora_adapters import make_adapter

pytestmark = pytest.mark.slow
TAIL = ("The ferry left the harbour at dawn, crossed the grey water under the gulls, and came back each evening "
        "with the tide. ")
# prefill TP, decode TP, decode replicas (the shipped file's model and sizes edited: SmolLM2 does not split over 2);
# every layout keeps local-tp.yaml's nixl (CPU pools of any TP sizes: pdcluster/config_sections.py `_copying`)
LAYOUTS = {"prefill-tp2-decode-tp1": (2, 1, 1), "prefill-tp1-decode-tp2": (1, 2, 2), "nixl-tp2-tp2": (2, 2, 1)}


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> str:
    return make_adapter(str(tmp_path_factory.mktemp("tp-lora") / "sql"), tiny, rank=8, seed=5)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, ray_session, adapter):
    prefill_tp, decode_tp, decode_replicas = LAYOUTS[request.param]

    def edit(config):
        config.model = "tiny"
        config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size = prefill_tp, decode_tp
        config.decode.replicas = decode_replicas
        config.lora.modules, config.lora.max_loras = {"sql": adapter}, 2  # NOTE: engine/parallel/lora.py
        for pool in (config.prefill, config.decode):
            pool.num_cpus, pool.num_kv_blocks, pool.max_restarts = 0.5, 512, 2

    c, server = start_test_cluster("deploy/local-tp.yaml", f"test-tp-{request.param}", edit=edit, port=0,
                                   slo_itl_ms=None, max_predicted_ttft_ms=600_000)
    yield request.param, c, server
    server.close()
    # a TP worker stopped for good (what a scale-down does once it drained) takes its placement group with it; so
    # does a stopped cluster
    from ray.util import placement_group_table

    from pdcluster.launch_actors import placement_name

    def states(name: str) -> list[str]:
        return [t["state"] for t in placement_group_table().values() if t["name"] == placement_name(c.config, name)]

    tp_worker = f"decode-{decode_replicas - 1}" if decode_tp > 1 else "prefill-0"
    assert states(tp_worker) == ["CREATED"]
    c.stop_worker(tp_worker)
    assert states(tp_worker) == ["REMOVED"]
    c.stop()
    left = [t for t in placement_group_table().values() if t["name"].startswith(f"test-tp-{request.param}/")]
    assert len(left) == decode_replicas * (decode_tp > 1) + (prefill_tp > 1), left
    assert all(t["state"] == "REMOVED" for t in left), left


def nixl_importable() -> bool:
    from kv_transfer.transports import unavailable

    return unavailable("nixl") is None


def prompts(tag: str, n: int, repeat: int = 1) -> list[str]:
    return [f"{tag} {i} {time.monotonic_ns()}: " + TAIL * repeat + f"What did the ferry do, {i}?" for i in range(n)]


def test_fresh_prompts_cross_the_handoff_and_equal_one_tp1_engine(cluster, tiny, ray_session):
    layout, c, server = cluster
    texts = prompts("fresh", 3)
    results = stream_greedy(server, texts, 16, "tp-fresh")
    assert [ids for ids, _ in results] == greedy_reference(tiny, texts, 16)
    for _, last in results:
        tl = last.timeline
        assert not tl.prefill_skipped and tl.prefill_worker.startswith("prefill-"), layout
        assert tl.kv_blocks_sent > 0 and last.usage.completion_tokens == 16
    if nixl_importable():  # NOTE: local-tp.yaml's nixl, for every layout: each worker's KV moved over it
        # NOTE: answered: in the second layout a worker restarted by the failover test may still be starting
        assert {answered(ray_session, a)["kv_transport"] for a in c.actors.values()} == {"nixl"}, layout


def test_a_prefix_cached_by_a_tp_group_is_hit_by_the_next_request(cluster, tiny):
    layout, c, server = cluster
    stub = server.stub()
    prefix = prompts("prefix", 1, repeat=4)[0]  # ~120 tokens: several full blocks
    second = prefix + " And once more, slowly: " + TAIL
    sampling = pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = stub.Generate(pb.GenerateRequest(prompt=prefix, sampling=sampling), timeout=120)
    assert first.usage.cached_prompt_tokens == 0 and not first.timeline.prefill_skipped
    # NOTE: the blocks reach the index through the holders' publishers (every 50 ms)
    wait_for(lambda: bool(c.index().workers()), 5)
    time.sleep(0.3)
    again = [stub.Generate(pb.GenerateRequest(prompt=t, sampling=sampling), timeout=120) for t in (second, prefix)]
    want = greedy_reference(tiny, [second, prefix], 8)
    for r, ids in zip(again, want):
        assert list(r.token_ids) == ids, layout
        assert r.usage.cached_prompt_tokens >= 4 * 16, (layout, r.usage, r.timeline)


def test_an_adapter_on_tp_groups_gives_one_tp1_engines_tokens_across_the_handoff(cluster, tiny, adapter):
    layout, c, server = cluster
    sampling = pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    texts = prompts("lora", 2)
    replies = [server.stub().Generate(pb.GenerateRequest(prompt=t, sampling=sampling, model="sql"), timeout=120)
               for t in texts]
    engine = make_engine(tiny, max_loras=1, max_lora_rank=8, num_blocks=256)
    engine.load_lora("sql", adapter)
    params = dataclasses.replace(greedy(16), lora="sql")
    want = generate_ids(engine, [engine.tokenizer.encode(t) for t in texts], params)
    for r, ids in zip(replies, want):
        assert list(r.token_ids) == ids
        assert not r.timeline.prefill_skipped and r.timeline.kv_blocks_sent > 0
    assert want != greedy_reference(tiny, texts, 16)  # NOTE: the adapter changes what the model says


@pytest.mark.parametrize("cluster", ["prefill-tp1-decode-tp2"], indirect=True)  # NOTE: two TP decode workers
def test_a_dead_follower_rank_takes_its_worker_out_and_the_streams_fail_over(cluster, tiny, ray_session):
    layout, c, server = cluster
    texts, n = prompts("failover", 4), 160  # NOTE: long enough to be mid-stream when the rank dies
    want = greedy_reference(tiny, texts, n)
    old = {w.name: w.epoch for w in c.index().workers()}
    started = threading.Event()
    with ThreadPoolExecutor(1) as bg:
        fut = bg.submit(stream_greedy, server, texts, n, "tp-failover", started)
        assert started.wait(120)
        running = {n: ray_session.get(c.actors[n].load.remote(), timeout=30).running for n in ("decode-0", "decode-1")}
        victim = max(running, key=running.__getitem__)
        assert running[victim] > 0, running
        info = ray_session.get(c.actors[victim].process.remote(), timeout=30)
        (follower,) = info["tp_follower_pids"]
        first = rank_actor(c, victim, info)
        os.kill(follower, signal.SIGKILL)
        results = fut.result(timeout=300)
    for (ids, last), ref in zip(results, want):
        assert ids == ref  # every token once, in order: none lost, none repeated
        assert last.usage.completion_tokens == n and last.finish_reason == "length"
    assert any(last.timeline.decode_worker != victim for _, last in results)
    # the whole worker went (its rank 0 ended its process) and Ray started it again: a new group, a new epoch
    assert wait_for(lambda: epoch(c, victim) > old[victim], 120)
    info = answered(ray_session, c.actors[victim])
    assert len(info["tp_follower_pids"]) == 1 and info["tp_follower_pids"] != [follower]
    # ... a fresh follower actor in the same placement group; the old one is dead, not restarted
    assert rank_actor(c, victim, info) != first and gcs_actor(first)["State"] == "DEAD"
    # an idle worker whose rank dies goes too, without waiting for a request to find out
    restarted = epoch(c, victim)
    os.kill(info["tp_follower_pids"][0], signal.SIGKILL)
    assert wait_for(lambda: epoch(c, victim) > restarted, 120)


def answered(ray_session, actor, timeout: float = 60) -> dict:
    """A restarted worker actor's process info, once it answers.

    NOTE: the worker registers its new epoch in the index from its constructor, which then goes on (a nixl decode
    worker sets up its agent and registers its pool); until the constructor returns, Ray fails calls to the actor
    at once (ActorUnavailableError: restarting) instead of queueing them."""
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray_session.get(actor.process.remote(), timeout=timeout)
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def epoch(c, name: str) -> int:
    """`name`'s epoch in the prefix index (-1 while it is not registered)."""
    return max((w.epoch for w in c.index().workers() if w.name == name), default=-1)


def test_a_tp_worker_no_node_can_hold_is_refused_and_leaves_no_placement_group(ray_session, monkeypatch):
    from ray.util import placement_group_table

    from pdcluster import launch_actors
    from pdcluster.config import ClusterConfig
    from router.errors import Overloaded

    config = ClusterConfig.from_yaml("deploy/local.yaml")
    config.ray.namespace = "test-tp-no-room"
    config.prefill.tensor_parallel_size, config.prefill.num_cpus = 2, 5.0  # NOTE: 10 CPUs; the test Ray has 8
    monkeypatch.setattr(launch_actors, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(Overloaded, match="worker prefill-0: its 2 ranks need CPU 5 each on one node"):
        launch_actors.place_ranks(config, config.prefill, "prefill-0")
    tables = [t for t in placement_group_table().values() if t["name"] == "test-tp-no-room/prefill-0-tp"]
    assert tables and all(t["state"] == "REMOVED" for t in tables)


def gcs_actor(actor_id: str) -> dict:
    """Ray's own record of an actor (the GCS's actor table; the state API needs the dashboard, off in tests)."""
    from ray._private.state import actors

    return actors(actor_id=actor_id)


def rank_actor(c, name: str, info: dict) -> str:
    """The actor id of worker `name`'s one follower, checked to be a Ray actor in bundle 1 of the worker's placement
    group, owned by the worker, on the worker's node."""
    from ray.util import get_placement_group, placement_group_table

    from pdcluster.launch_actors import placement_name

    (place,) = info["tp_ranks"]
    pg = get_placement_group(placement_name(c.config, name))
    table = placement_group_table(pg)
    worker = gcs_actor(c.actors[name]._actor_id.hex())
    node = worker["Address"]["NodeID"]
    assert (table["strategy"], table["state"], len(table["bundles"])) == ("STRICT_PACK", "CREATED", 2)
    assert set(table["bundles_to_node_id"].values()) == {node}
    assert (place.rank, place.pid, place.placement_group, place.node_id) == (1, info["tp_follower_pids"][0],
                                                                             pg.id.hex(), node)
    rank = gcs_actor(place.actor_id)
    assert rank["ActorClassName"].endswith("TPRank") and rank["State"] == "ALIVE" and rank["Pid"] == place.pid
    assert not rank["IsDetached"] and rank["OwnerAddress"]["Port"] == worker["Address"]["Port"]
    return str(place.actor_id)
