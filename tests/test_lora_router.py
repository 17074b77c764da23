"""The router's LoRA adapters (router/lora.py) over real workers in-process (the tiny model, no Ray: each actor's
methods are called directly): a `model` resolves to an adapter or NOT_FOUND, a load reaches every worker or none, an
adapter in use is not unloaded, a fresh worker process gets the adapters loaded at run time, and a worker that lacks
an adapter (a fresh one until then, or one whose load failed) is not picked for its requests."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.messages import Role, WorkerLoad
from cluster.worker import WorkerSpec
from cluster.worker_actor import WorkerActor
from decode_workers.worker import DecodeWorker
from engine import EngineConfig, InvalidRequestError
from prefill_workers.worker import PrefillWorker
from router.errors import ModelNotFound
from router.lora import Adapters
from router.policy import WorkerView
from router.pools import WorkerHandle, WorkerPools
from router.settings import RouterSettings
from tests.helpers import greedy
from tests.lora_adapters import make_adapter

CFG = EngineConfig(num_blocks=128, num_threads=1, max_loras=2, max_lora_rank=16)


class Direct(WorkerActor):
    """A worker's actor methods without Ray: `handle.actor.load_lora.remote(...)` calls the method here."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        return SimpleNamespace(remote=attr) if name in ("load_lora", "unload_lora") else attr


def handle(worker: Any) -> Any:
    return SimpleNamespace(name=worker.name, actor=Direct(worker))


@pytest.fixture(scope="module")
def paths(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"small": make_adapter(str(root / "small"), tiny, rank=4, seed=1),
            "big": make_adapter(str(root / "big"), tiny, rank=16, seed=2)}


@pytest.fixture()
def workers(tiny, paths):
    p = PrefillWorker(WorkerSpec("prefill-0", "prefill", "tiny", CFG, lora_modules=(("small", paths["small"]),)),
                      tiny)
    # NOTE: this one takes ranks up to 8 only: "big" is refused here and accepted on the prefill worker
    d = DecodeWorker(WorkerSpec("decode-0", "decode", "tiny", dataclasses.replace(CFG, max_lora_rank=8),
                                lora_modules=(("small", paths["small"]),)), tiny)
    yield p, d
    p.close()
    d.close()


def test_the_yamls_adapters_are_loaded_at_start_and_a_model_resolves_to_one(workers):
    p, d = workers
    assert p.info().loras == d.info().loras and set(p.info().loras) == {"small"}
    adapters = Adapters(p.info().loras)
    assert adapters.resolve("small", "tiny") == "small"
    assert adapters.resolve("tiny", "tiny") is None and adapters.resolve(None, "tiny") is None
    with pytest.raises(ModelNotFound) as e:
        adapters.resolve("nope", "tiny")
    assert "`nope`" in str(e.value) and "small" in str(e.value)
    assert adapters.key("small").startswith("lora:small:") and adapters.key(None) == ""


def test_a_load_refused_by_one_worker_is_undone_on_the_others(workers, paths):
    p, d = workers
    adapters = Adapters(p.info().loras)
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(adapters.load([handle(p), handle(d)], "big", paths["big"], "tiny"))
    assert e.value.field == "lora_path" and "rank 16 exceeds max_lora_rank 8" in str(e.value)
    assert p.engine.lora_names() == d.engine.lora_names() == ["small"]  # NOTE: the prefill worker let it go
    assert "big" not in adapters.keys
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(adapters.load([handle(p), handle(d)], "x", "/no/such/dir", "tiny"))
    assert "adapter_config.json" in str(e.value)
    for bad in ("tiny", "my adapter", "a\nb", "ab\n", ""):
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(adapters.load([handle(p), handle(d)], bad, paths["small"], "tiny"))
        assert e.value.field == "lora_name"
    assert p.engine.lora_names() == ["small"]


def test_an_adapter_in_use_is_not_unloaded_and_a_fresh_worker_gets_the_run_time_ones(workers, paths, tiny):
    p, d = workers
    adapters = Adapters(p.info().loras)

    async def scenario() -> None:
        await adapters.load([handle(p), handle(d)], "small2", paths["small"], "tiny")
        assert set(p.engine.lora_names()) == set(d.engine.lora_names()) == {"small", "small2"}
        d.engine.add_request("busy", [1, 2, 3, 4], dataclasses.replace(greedy(4), lora="small2"))
        with pytest.raises(InvalidRequestError) as e:
            await adapters.unload([handle(p), handle(d)], "small2")
        assert "in use" in str(e.value) and "small2" in adapters.keys
        # NOTE: all or none: the prefill worker, which had let it go, has it again (the same files, the same key)
        assert p.info().loras["small2"] == d.info().loras["small2"] == adapters.keys["small2"]
        d.engine.abort_request("busy")
        await adapters.unload([handle(p), handle(d)], "small2")
        assert "small2" not in adapters.keys and d.engine.lora_names() == ["small"]
        with pytest.raises(ModelNotFound):
            await adapters.unload([handle(p), handle(d)], "small2")
        # a worker process that joins now (a scale-up, a restart) started with the YAML's adapters only
        await adapters.load([handle(p), handle(d)], "again", paths["small"], "tiny")
        fresh = PrefillWorker(WorkerSpec("prefill-1", "prefill", "tiny", CFG,
                                         lora_modules=(("small", paths["small"]),)), tiny)
        try:
            adapters.restore(handle(fresh))
            await adapters.restored()
            assert fresh.info().loras == p.info().loras
        finally:
            fresh.close()
    asyncio.run(scenario())


def test_workers_export_vllms_lora_requests_info(workers, tiny):
    from prometheus_client import generate_latest

    _, d = workers
    d.engine.add_request("waits", [1, 2, 3, 4], dataclasses.replace(greedy(4), lora="small"))
    try:
        text = generate_latest(d.metrics.registry).decode()
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters="small"}' in text
    finally:
        d.engine.abort_request("waits")
    plain = DecodeWorker(WorkerSpec("decode-9", "decode", "tiny", dataclasses.replace(CFG, max_loras=0)), tiny)
    try:  # NOTE: as vLLM without --enable-lora: no such series
        assert "lora_requests_info" not in generate_latest(plain.metrics.registry).decode()
    finally:
        plain.close()


def pooled(worker: Any, **load: int) -> WorkerHandle:
    """A real worker as the router's pools hold it (its actor called directly), with a chosen load."""
    info = worker.info()
    return WorkerHandle(worker.name, Role(info.role), Direct(worker), info,
                        WorkerView(worker.name, 1000, 8, load=WorkerLoad(free_blocks=1000, **load)))


def test_a_worker_lacking_an_adapter_is_never_picked_for_it(workers, paths, tiny):
    p, d = workers
    # NOTE: decode-0 is busy: on load alone every request would go to a fresh, idle decode worker
    pools = WorkerPools([pooled(p), pooled(d, running=4)], RouterSettings(model="tiny", mode="disaggregated")
                        .policy(16))
    adapters = Adapters(p.info().loras, pools.missing)
    pools.on_new_process.append(adapters.restore)
    # NOTE: one slot, taken by the YAML's adapter: the run-time one cannot be loaded there (slots full)
    full = DecodeWorker(WorkerSpec("decode-1", "decode", "tiny", dataclasses.replace(CFG, max_loras=1),
                                   lora_modules=(("small", paths["small"]),)), tiny)
    roomy = DecodeWorker(WorkerSpec("decode-2", "decode", "tiny", CFG, lora_modules=(("small", paths["small"]),)),
                         tiny)

    def decode_for(lora: str | None) -> set[str]:
        return {pools.route(100, 8, {}, lora).decode for _ in range(4)}

    async def scenario() -> None:
        await adapters.load(pools.by_name.values(), "run", paths["small"], "tiny")
        pools.add(pooled(full))
        # NOTE: at once, before its load answers: a fresh process has only the YAML's adapters
        assert pools.missing["decode-1"] == {"run"}
        assert decode_for("run") == {"decode-0"} and decode_for("small") == decode_for(None) == {"decode-1"}
        await adapters.restored()
        assert full.engine.lora_names() == ["small"] and pools.missing["decode-1"] == {"run"}  # its load failed
        assert decode_for("run") == {"decode-0"} and decode_for(None) == {"decode-1"}
        got = pools.pick_decode(100, 8, set(), "run")
        assert got is not None and got.name == "decode-0"
        pools.add(pooled(roomy))
        await adapters.restored()
        assert roomy.engine.lora_names() == ["small", "run"] and not pools.missing["decode-2"]
        assert "decode-2" in decode_for("run") and "decode-1" not in decode_for("run")
        await adapters.unload(pools.by_name.values(), "run")
        assert not any(pools.missing.values())
    try:
        asyncio.run(scenario())
    finally:
        full.close()
        roomy.close()
