"""Issue 27 without a cluster: a worker that starts while Redis is down, the embedded Redis that dies, heartbeats
signed with the cluster token. Real redis-servers, the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import aiohttp
import grpc
import pytest

from cluster.leases import RequestLeases
from cluster.messages import WorkerLoad
from cluster.prefix_index import PrefixIndex, heartbeat_key
from cluster.redis_client import RedisAuth
from cluster.worker import WorkerSpec
from decode_workers.worker import DecodeWorker
from engine import EngineConfig
from kv_transfer.state import TransferConfig
from pdcluster import security
from pdcluster.config import ClusterConfig, ConfigError
from pdcluster.redis_server import EmbeddedRedis, _free_port, connect
from router.openai_api import start_http
from router.pinger import Ping
from router.service import start_server
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import wait_for
from tests.unit_router import unit_router

REPO = Path(__file__).resolve().parent.parent


def test_a_worker_started_while_redis_is_down_serves_and_registers_once_redis_is_back(tiny) -> None:
    port, password, key_prefix = _free_port(), "pw-" + uuid.uuid4().hex, "t" + uuid.uuid4().hex[:8]
    url = f"redis://127.0.0.1:{port}/0"
    spec = WorkerSpec("decode-0", "decode", "tiny", EngineConfig(num_blocks=32, num_threads=1), TransferConfig(), url,
                      key_prefix, redis_auth=RedisAuth(password=password))
    worker = DecodeWorker(spec, tiny)  # NOTE: raised before (Ray would have marked the actor dead for good)
    try:
        assert worker.epoch == 0
        with EmbeddedRedis(port, password=password) as server:
            index = PrefixIndex(connect(server.url), key_prefix)
            assert wait_for(lambda: [w.name for w in index.workers()] == ["decode-0"])
            assert index.current_epoch("decode-0") == worker.epoch > 0
    finally:
        worker.close()


def test_the_supervised_embedded_redis_comes_back_on_its_port_with_its_password() -> None:
    with EmbeddedRedis() as server:
        server.supervise()
        port, password, pid = server.port, server.password, server.pid
        client = connect(server.url)
        os.kill(pid, signal.SIGKILL)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except Exception:  # noqa: BLE001 - down until the supervisor restarted it
                return False

        assert wait_for(answers)  # the same client: same port, same password
        assert wait_for(lambda: server.restarts == 1)
        assert (server.port, server.password, server.restarts, server.failure) == (port, password, 1, None)
        assert server.pid != pid
    assert not answers()  # stop() ends the supervision too: nothing restarts it


def test_a_forged_heartbeat_is_ignored_and_its_address_never_reaches_the_reader() -> None:
    key, key_prefix = heartbeat_key("the-cluster-token"), "t" + uuid.uuid4().hex[:8]
    with EmbeddedRedis() as server:
        client = connect(server.url)
        worker, reader = PrefixIndex(client, key_prefix, signing_key=key), PrefixIndex(client, key_prefix,
                                                                                      signing_key=key)
        epoch = worker.register_worker("decode-0")
        assert worker.heartbeat("decode-0", epoch, "decode", "10.0.0.2:7000", WorkerLoad(free_blocks=9))
        assert [(w.name, w.address, w.load.free_blocks) for w in reader.workers()] == [("decode-0", "10.0.0.2:7000",
                                                                                        9)]
        # someone with write access to Redis redirects the worker's KV address ...
        client.hset(f"{key_prefix}:hb:decode-0", "address", "203.0.113.9:7000")
        assert reader.workers() == [] and reader.forged_heartbeats == 1
        # ... or writes a heartbeat of their own, unsigned or signed with another token, under the current epoch
        for forger in (PrefixIndex(client, key_prefix), PrefixIndex(client, key_prefix,
                                                                   signing_key=heartbeat_key("a-guess"))):
            assert forger.heartbeat("decode-0", epoch, "decode", "203.0.113.9:7000", WorkerLoad())
            assert reader.workers() == []
        assert reader.forged_heartbeats == 3
        assert worker.heartbeat("decode-0", epoch, "decode", "10.0.0.2:7000", WorkerLoad())  # the worker's next beat
        assert [w.address for w in reader.workers()] == ["10.0.0.2:7000"]


def test_an_inference_key_cannot_scale_and_an_admin_key_can(tiny) -> None:
    router = unit_router(tiny)

    async def check() -> dict[str, grpc.StatusCode]:
        server, port = await start_server(router, "127.0.0.1", 0, api_keys=frozenset({"sk-infer"}),
                                          admin_keys=frozenset({"sk-admin"}))
        codes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.InferenceStub(channel)
                for who in ("", "sk-infer", "sk-admin"):
                    metadata = (("authorization", f"Bearer {who}"),) if who else ()
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Scale(pb.ScaleRequest(decode=2), metadata=metadata, timeout=10)
                    codes[who or "no key"] = e.value.code()
                # both kinds of key open inference calls
                for who in ("sk-infer", "sk-admin"):
                    st = await stub.GetClusterStatus(pb.ClusterStatusRequest(),
                                                     metadata=(("authorization", f"Bearer {who}"),), timeout=10)
                    assert st.model
        finally:
            await server.stop(None)
            await router.close()
        return codes

    # NOTE: the admin key gets past the check: this router has no scaler, so Scale itself answers UNIMPLEMENTED
    assert asyncio.run(check()) == {"no key": grpc.StatusCode.UNAUTHENTICATED,
                                    "sk-infer": grpc.StatusCode.PERMISSION_DENIED,
                                    "sk-admin": grpc.StatusCode.UNIMPLEMENTED}


@pytest.mark.parametrize("name", ["cpu-multinode.yaml", "gpu-cluster.yaml", "planned-h100.yaml",
                                  "planned-h100-70b.yaml"])
def test_the_multi_node_yamls_take_the_redis_password_from_the_environment(name: str, monkeypatch) -> None:
    config = ClusterConfig.from_yaml(REPO / "deploy" / name)
    assert config.redis.url and config.redis.password_env == "PDCLUSTER_REDIS_PASSWORD"
    monkeypatch.delenv("PDCLUSTER_REDIS_PASSWORD", raising=False)
    with pytest.raises(security.SetupError, match="redis.password_env.*PDCLUSTER_REDIS_PASSWORD"):
        security.redis_auth(config)  # not set: refused at start, naming the field and the variable
    monkeypatch.setenv("PDCLUSTER_REDIS_PASSWORD", "pw-1")
    assert security.redis_auth(config).password == "pw-1"


def test_a_lease_runs_out_one_period_after_the_last_renewal_of_the_request_or_its_attempts() -> None:
    leases = RequestLeases()
    assert leases.expired(["r1"], now=0.0) == [] and leases.expired(["r1"], now=100.0) == []  # off: no router
    leases.renew(["r1", "r2"], lease_s=5.0, now=100.0)
    running = ["r1~a1b2c3d4", "r2", "direct"]  # an attempt of r1, r2 itself, one no router sent
    assert leases.expired(running, now=100.0) == [] and leases.expired(running, now=104.9) == []
    leases.renew(["r1"], lease_s=5.0, now=104.9)  # r2's router is gone; r1's renews
    assert leases.expired(running, now=105.5) == ["r2", "direct"]  # "direct": covered from when first seen
    assert leases.expired(running, now=110.0) == ["r1~a1b2c3d4", "r2", "direct"]
    assert leases.expired(["r3"], now=110.0) == []  # a request seen for the first time gets a whole period


def test_live_answers_503_once_only_a_restart_helps_and_health_reads_pings_while_redis_is_down(tiny) -> None:
    router = unit_router(tiny)
    prefill, decode = router.pools.by_name["prefill-0"], router.pools.by_name["decode-0"]
    redis_gone: list[str] = []
    router.fatal_checks.append(lambda: redis_gone[0] if redis_gone else None)

    async def probe() -> list[tuple[int, int]]:
        runner, port = await start_http(router, host="127.0.0.1", port=0, model_name="tiny")
        seen = []
        try:
            async with aiohttp.ClientSession() as http:
                async def codes() -> tuple[int, int]:
                    out = []
                    for path in ("/live", "/health"):
                        async with http.get(f"http://127.0.0.1:{port}{path}") as r:
                            out.append(r.status)
                    return out[0], out[1]

                seen.append(await codes())  # nothing known yet
                await router._on_pings([Ping(prefill, "", 0.01), Ping(decode, "ActorUnavailableError", 0.01)])
                router._set_live(set(router._answering or ()))  # NOTE: what the refresher does while Redis is down
                seen.append(await codes())  # the decode worker restarting: not ready, but alive
                await router._on_pings([Ping(prefill, "", 0.01), Ping(decode, "ActorDiedError", 0.01)])
                seen.append(await codes())  # dead for good: only a restart of the process helps
                await router._on_pings([Ping(prefill, "", 0.01), Ping(decode, "", 0.01)])
                router._set_live(set(router._answering or ()))
                redis_gone.append("the embedded Redis cannot be restarted")
                seen.append(await codes())
        finally:
            await runner.cleanup()
            await router.close()
        return seen

    assert asyncio.run(probe()) == [(200, 200), (200, 503), (503, 503), (503, 200)]


@pytest.mark.parametrize("ray,security,field", [
    ({"keep_workers": True}, {"cluster_token_env": "T"}, "ray.keep_workers"),  # a private Ray goes with serve
    ({"keep_workers": True, "address": "auto"}, {}, "ray.keep_workers"),  # a random token: never re-attached
])
def test_keep_workers_needs_a_ray_that_outlives_serve_and_a_stable_cluster_token(ray, security, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ClusterConfig.from_data({"ray": ray, "security": security}, "test")
    ClusterConfig.from_data({"ray": {"keep_workers": True, "address": "auto"}, "security": {"cluster_token_env": "T"}},
                            "test")
