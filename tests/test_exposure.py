"""What a local user or a network neighbour can reach: the embedded Redis's password and commands, API keys kept off
argv, and the router refusing to serve other machines without keys (issue 19, items 10 and 12)."""

from __future__ import annotations

import os
import stat

import psutil
import pytest
import redis

from pdcluster import security
from pdcluster.cli import build_parser, read_api_key_file
from pdcluster.config import ClusterConfig
from pdcluster.redis_server import EmbeddedRedis, connect, embedded_password, password_file

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
