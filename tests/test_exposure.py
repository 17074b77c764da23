"""What a local user or a network neighbour can reach: the embedded Redis's password and commands, API keys kept off
argv, and the router refusing to serve other machines without keys (issue 19, items 10 and 12)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import stat
import subprocess
import sys

import psutil
import pytest
import redis
import yaml

from pdcluster import security
from pdcluster.cli import build_parser, read_api_key_file
from pdcluster.config import ClusterConfig
from pdcluster.redis_files import embedded_password, password_file
from pdcluster.redis_server import EmbeddedRedis, connect
from router import auth
from tests.unit_router import unit_router

REPO = pathlib.Path(__file__).resolve().parent.parent


# ---- the embedded Redis (item 12) ----

def test_the_embedded_redis_wants_a_password_made_per_start_and_kept_off_argv() -> None:
    with EmbeddedRedis() as first, EmbeddedRedis() as second:
        assert first.password and second.password and first.password != second.password
        with pytest.raises(redis.AuthenticationError):  # a local user without the password reads nothing
            connect(f"redis://127.0.0.1:{first.port}/0").get(b"pdc:workers")
        assert connect(first.url).ping()
        argv = " ".join(psutil.Process(first.pid).cmdline())
        assert first.password not in argv and "requirepass" not in argv


def test_the_embedded_redis_has_no_config_debug_or_module_command() -> None:
    with EmbeddedRedis() as server:
        c = connect(server.url)
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "requirepass"), ("DEBUG", "SLEEP", "0"),
                        ("MODULE", "LIST")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                c.execute_command(*command)
        assert c.set(b"k", b"v") and c.get(b"k") == b"v"  # what the cluster uses still works


@pytest.mark.parametrize("password", ['has "quotes" and \\backslashes\\', "spaces and # hash", "ünïcode-ß",
                                      "trailing\\"], ids=["quotes", "spaces", "unicode", "trailing-backslash"])
def test_a_configured_password_is_quoted_in_the_config_file(password: str) -> None:
    with EmbeddedRedis(password=password) as server:
        assert connect(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://127.0.0.1:{server.port}/0").get(b"k")


def test_an_extra_router_of_the_same_user_finds_the_password_in_a_private_file() -> None:
    with EmbeddedRedis() as server:
        path = password_file(server.port)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert embedded_password(server.port) == server.password
        config = ClusterConfig.from_yaml_text(f"redis:\n  url: redis://127.0.0.1:{server.port}/0\n")
        assert connect(config.redis.url or "", security.redis_auth(config)).ping()
    assert not os.path.exists(path)  # gone with the server


# ---- API keys off argv (item 12) ----

def test_the_client_reads_its_api_key_from_a_file(tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    args = build_parser().parse_args(["status", "--addr", "127.0.0.1:1", "--api-key-file", str(key_file)])
    assert read_api_key_file(args.api_key_file) == "sk-from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file"):
        read_api_key_file(str(tmp_path / "empty"))


# ---- no open router on the network without keys (item 10) ----

def _shipped_configs() -> dict[str, str]:
    """Every deploy YAML of the repository (and the one the KubeRay manifest embeds), as name → text."""
    launchers = ("kuberay-raycluster.yaml", "ray-cluster-aws.yaml")  # no pdcluster config of their own
    out = {p.name: p.read_text() for p in sorted((REPO / "deploy").glob("*.yaml")) if p.name not in launchers}
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kuberay-raycluster.yaml").read_text()))
    out["kuberay-raycluster.yaml:ConfigMap"] = next(d for d in docs if d and d["kind"] == "ConfigMap")["data"][
        "cluster.yaml"]
    return out


SHIPPED = _shipped_configs()


@pytest.mark.parametrize("name", list(SHIPPED))
def test_every_shipped_yaml_serves_other_machines_only_with_keys_from_the_environment(name: str, monkeypatch) -> None:
    config = ClusterConfig.from_yaml_text(SHIPPED[name], name)
    exposed = [h for h in (config.router.host, config.http.host) if not auth.is_loopback(h)]
    assert not config.security.allow_unauthenticated
    if not exposed:  # a laptop config: serves this machine only, no key needed
        security.check_exposure(config)
        return
    variable = config.security.api_keys_env
    assert variable, f"{name} binds {exposed} without security.api_keys_env"
    monkeypatch.delenv(variable, raising=False)
    with pytest.raises(security.SetupError, match=variable):  # not set: refused at start, naming the variable
        security.check_exposure(config)
    monkeypatch.setenv(variable, "sk-a,sk-b")
    security.check_exposure(config)
    assert security.api_keys(config) == {"sk-a", "sk-b"}
    config.security.api_keys_env = None  # the same file without its security section is refused
    with pytest.raises(security.SetupError, match="router.host.*security.allow_unauthenticated"):
        security.check_exposure(config)
    config.security.allow_unauthenticated = True  # ... unless it says so
    security.check_exposure(config)


def test_admin_keys_come_from_their_own_variable_and_one_that_holds_none_is_refused(monkeypatch) -> None:
    config = ClusterConfig()
    assert security.admin_api_keys(config) == frozenset()  # unset: the API keys open admin calls too
    config.security.admin_api_keys_env = "PDC_TEST_ADMIN_KEYS"
    monkeypatch.setenv("PDC_TEST_ADMIN_KEYS", " sk-admin-1 ,sk-admin-2,")
    assert security.admin_api_keys(config) == {"sk-admin-1", "sk-admin-2"}
    monkeypatch.setenv("PDC_TEST_ADMIN_KEYS", " , ")
    with pytest.raises(security.SetupError, match="security.admin_api_keys_env: PDC_TEST_ADMIN_KEYS holds no key"):
        security.admin_api_keys(config)


def test_the_ray_up_recipe_gives_the_router_its_keys() -> None:
    text = (REPO / "deploy" / "ray-cluster-aws.yaml").read_text()
    gpu = ClusterConfig.from_yaml(REPO / "deploy" / "gpu-cluster.yaml")
    serve = next(line for line in text.splitlines() if "pdcluster serve --config deploy/gpu-cluster.yaml" in line)
    assert f"{gpu.security.api_keys_env}=" in serve


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                           ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
                                           ("10.1.2.3", False)])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert auth.is_loopback(host) is loopback


def test_the_fronts_refuse_to_bind_a_network_address_without_keys(tiny) -> None:
    from router.openai_api import start_http
    from router.service import start_server

    router = unit_router(tiny)

    async def bind() -> list[str]:
        refused = []
        for name, start in (("router.host", lambda **kw: start_server(router, "0.0.0.0", 0, **kw)),
                            ("http.host", lambda **kw: start_http(router, host="0.0.0.0", port=0,
                                                                   model_name="tiny", **kw))):
            with pytest.raises(auth.ExposureError, match=name):
                await start()
            refused.append(name)
            for kw in ({"api_keys": frozenset({"sk-1"})}, {"allow_unauthenticated": True}):
                server, port = await start(**kw)
                assert port > 0
                await (server.stop(None) if name == "router.host" else server.cleanup())
        await router.close()
        return refused
    assert asyncio.run(bind()) == ["router.host", "http.host"]


def test_serve_refuses_an_open_network_config_before_starting_anything(tmp_path) -> None:
    bad = tmp_path / "open.yaml"
    bad.write_text("model: tiny\nrouter:\n  host: 0.0.0.0\n")
    proc = subprocess.run([sys.executable, "-m", "pdcluster", "serve", "--config", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "router.host" in proc.stderr and "api_keys_env" in proc.stderr, proc.stderr
    assert "cluster up" not in proc.stderr


def test_with_keys_reflection_needs_one_too_and_health_stays_open(tiny) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from router.service import start_server

    router = unit_router(tiny)

    async def check() -> None:
        server, port = await start_server(router, "127.0.0.1", 0, api_keys=frozenset({"sk-1"}))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.ServerReflectionInfo(iter([ask])):
                        pass
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                replies = [r async for r in stub.ServerReflectionInfo(
                    iter([ask]), metadata=(("authorization", "Bearer sk-1"),))]
                names = {s.name for s in replies[0].list_services_response.service}
                assert "pdcluster.v1.Inference" in names
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)
            await router.close()
    asyncio.run(check())
