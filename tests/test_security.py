"""Security of a running cluster: TLS, API keys, the Redis password, the cluster token on KV ports; and metrics.

One small cluster (the tiny model, 1 prefill + 1 decode) runs with every protection on: API keys from an
environment variable, a self-signed certificate made here, an embedded Redis with a password, a cluster token.
"""

from __future__ import annotations

import logging
import re
import urllib.request

import grpc
import pytest
import redis

from pdcluster import security
from pdcluster.redis_server import connect
from pdcluster.serve import make_router
from router.v1 import inference_pb2 as pb
from tests.helpers import RouterServer, self_signed_cert, start_test_cluster

pytestmark = pytest.mark.slow
KEY = "sk-test-7f3a9c"
ENV = {"PDC_TEST_API_KEYS": f"other-key,{KEY}", "PDC_TEST_REDIS_PASSWORD": "redis-pw-91", "PDC_TEST_TOKEN": "tok-55"}


def greedy(n: int = 4) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def secured(ray_session, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for k, v in ENV.items():
        mp.setenv(k, v)
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))

    def edit(config):
        config.model = "tiny"
        config.security.api_keys_env = "PDC_TEST_API_KEYS"
        config.security.cluster_token_env = "PDC_TEST_TOKEN"
        config.security.tls_cert_file, config.security.tls_key_file = cert, key
        config.redis.password_env = "PDC_TEST_REDIS_PASSWORD"
        for pool in (config.prefill, config.decode):
            pool.num_cpus, pool.num_kv_blocks = 0.5, 256

    with open(cert, "rb") as c_file, open(key, "rb") as k_file:
        credentials = grpc.ssl_server_credentials([(k_file.read(), c_file.read())])
    # NOTE: slo_itl_ms None: the request must cross the handoff, which the SLO placement rule may skip on busy cores
    keys = frozenset(ENV["PDC_TEST_API_KEYS"].split(","))
    c, server = start_test_cluster("deploy/local.yaml", "test-security", edit=edit, port=0, slo_itl_ms=None,
                                   server_kwargs={"api_keys": keys, "credentials": credentials})
    yield c, server, cert
    server.close()
    c.stop()
    mp.undo()


def test_tls_round_trip_with_a_self_signed_certificate(secured):
    _, server, cert = secured
    r = server.stub(KEY, tls_ca=cert).Generate(pb.GenerateRequest(prompt="hello", sampling=greedy()), timeout=60)
    assert r.usage.completion_tokens == 4 and r.timeline.prefill_worker == "prefill-0"  # KV moved with the token
    with pytest.raises(grpc.RpcError) as e:  # a plaintext client cannot talk to the TLS port
        server.stub(KEY).Generate(pb.GenerateRequest(prompt="hello", sampling=greedy()), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("key", [None, "", "sk-wrong", KEY + "x"], ids=["none", "empty", "wrong", "longer"])
def test_calls_without_a_valid_api_key_are_unauthenticated_and_the_key_is_never_logged(secured, key, caplog):
    _, server, cert = secured
    caplog.set_level(logging.DEBUG)
    stub = server.stub(key, tls_ca=cert)
    for call in (lambda: stub.Generate(pb.GenerateRequest(prompt="hi", sampling=greedy()), timeout=30),
                 lambda: list(stub.GenerateStream(pb.GenerateRequest(prompt="hi", sampling=greedy()), timeout=30)),
                 lambda: stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in e.value.details()
    ok = server.stub(KEY, tls_ca=cert).Generate(pb.GenerateRequest(prompt="hi", sampling=greedy()), timeout=60)
    assert ok.usage.completion_tokens == 4
    assert KEY not in caplog.text and "other-key" not in caplog.text
    if key:
        assert key not in caplog.text


def test_http_front_over_tls_needs_the_key(secured):
    import json
    import ssl
    import urllib.error

    from router.openai_api import start_http

    c, server, cert = secured
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, cert.replace("cert.pem", "key.pem"))
    runner, port = server.run(start_http(server.router, host="127.0.0.1", port=0, model_name="tiny",
                                         api_keys=frozenset(ENV["PDC_TEST_API_KEYS"].split(",")), ssl_context=tls))
    client_tls = ssl.create_default_context(cafile=cert)
    try:
        def get(path: str, key: str | None) -> tuple[int, dict]:
            req = urllib.request.Request(f"https://127.0.0.1:{port}{path}",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
            try:
                with urllib.request.urlopen(req, timeout=30, context=client_tls) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        assert get("/v1/models", KEY)[0] == 200
        status, body = get("/v1/models", None)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert get("/v1/models", "sk-nope")[0] == 401
        assert get("/health", None) == (200, {"status": "ok"})
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP to the TLS port fails
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        server.run(runner.cleanup())


def test_health_stays_open_without_a_key(secured):
    _, server, cert = secured
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open(cert, "rb") as f:
        channel = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(f.read()))
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_redis_needs_the_password(secured):
    c, server, cert = secured
    url = f"redis://127.0.0.1:{c.redis.port}/0"
    with pytest.raises(redis.exceptions.AuthenticationError):
        connect(url).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        connect(url, security.RedisAuth(password="wrong")).ping()
    assert connect(url, security.RedisAuth(password=ENV["PDC_TEST_REDIS_PASSWORD"])).ping()
    st = server.stub(KEY, tls_ca=cert).GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    assert st.redis_ok and all(w.alive for w in st.workers)  # the workers write to it with the password


def test_redis_acl_user_and_password_from_the_config(monkeypatch):
    from pdcluster.config import ClusterConfig
    from pdcluster.redis_server import EmbeddedRedis

    with EmbeddedRedis(password="admin-pw") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        admin = connect(url, security.RedisAuth(password="admin-pw"))
        admin.execute_command("ACL", "SETUSER", "pdc-router", "on", ">router-pw", "~pdc:*", "+@all")
        config = ClusterConfig.from_yaml_text(f"redis:\n  url: {url}\n  username: pdc-router\n"
                                              "  password_env: PDC_TEST_ACL_PW\n")
        with pytest.raises(security.SetupError, match="PDC_TEST_ACL_PW"):  # names the variable to set
            security.redis_auth(config)
        monkeypatch.setenv("PDC_TEST_ACL_PW", "router-pw")
        user = connect(url, security.redis_auth(config))
        assert user.set("pdc:probe", b"1") and user.get("pdc:probe") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.set("other:key", b"1")  # the ACL confines this user to the cluster's key prefix
        monkeypatch.setenv("PDC_TEST_ACL_PW", "wrong")
        with pytest.raises(redis.exceptions.AuthenticationError):
            connect(url, security.redis_auth(config)).ping()


def test_a_kv_port_refuses_callers_without_the_cluster_token(secured):
    from engine.block_hash import hash_prompt_blocks
    from engine.kv_export import KVLayout
    from kv_transfer import TransferConfig, TransferError, open_sender

    c, _, _ = secured
    info = c.infos["decode-0"]
    tokens = list(range(10, 42))
    layout = KVLayout(info.scope, "float32", 2, info.block_size, 2, 16)
    for token in ("", "tok-wrong"):
        sender = open_sender(TransferConfig(cluster_token=token), info.kv_address, f"outsider-{token}", layout,
                             tokens, len(tokens), hash_prompt_blocks(tokens, info.block_size, info.scope))
        with pytest.raises(TransferError, match="UNAUTHENTICATED"):
            sender.prepare()


def test_metrics_after_twenty_requests_match_what_was_sent(secured):
    """A fresh router on the same workers: 17 good requests, 2 invalid, 1 shed; the scrape adds up exactly."""
    from router.metrics_http import start_metrics_server

    c, _, _ = secured
    router = make_router(c)
    router.max_inflight = 1
    server = RouterServer(router)
    try:
        runner, port = server.run(start_metrics_server(router.metrics, "127.0.0.1", 0))
        stub = server.stub()
        usages = []
        for i in range(17):
            req = pb.GenerateRequest(prompt=f"request number {i}", sampling=greedy(3 + i % 3))
            usages.append((stub.Generate if i % 2 else _stream_as_unary(stub))(req, timeout=60).usage)
        for bad in (pb.GenerateRequest(), pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=3))):
            with pytest.raises(grpc.RpcError):
                stub.Generate(bad, timeout=30)
        long = stub.GenerateStream(pb.GenerateRequest(prompt="long one", sampling=pb.SamplingParams(
            max_tokens=200, temperature=0, ignore_eos=True)), timeout=120)
        next(long)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="shed", sampling=greedy()), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        long.cancel()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        server.run(runner.cleanup())
    finally:
        server.close()

    def value(name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$"
        m = re.search(pattern, text, re.M)
        assert m, f"{name}{labels} not in the scrape"
        return float(m.group(1))
    assert value("pdcluster_requests_total", api="grpc", status="OK") == 17
    assert value("pdcluster_requests_total", api="grpc", status="INVALID_ARGUMENT") == 2
    assert value("pdcluster_requests_total", api="grpc", status="RESOURCE_EXHAUSTED") == 1
    assert value("pdcluster_time_to_first_token_seconds_count") == 17
    assert value("pdcluster_e2e_request_latency_seconds_count") == 17
    gen = sum(u.completion_tokens for u in usages)
    assert value("pdcluster_generation_tokens_total") == gen
    assert value("pdcluster_inter_token_latency_seconds_count") == gen - 17  # one gap per token after the first
    assert value("pdcluster_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value("pdcluster_prefix_cache_hit_tokens_total") == sum(u.cached_prompt_tokens for u in usages)
    assert value("pdcluster_kv_transfer_bytes_total", transport=c.config.transfer.transport) > 0
    assert value("pdcluster_redis_lookup_seconds_count") == 18  # every routed request, the shed one excluded


def _stream_as_unary(stub):
    def call(req, timeout):
        chunks = list(stub.GenerateStream(req, timeout=timeout))
        return chunks[-1]
    return call
