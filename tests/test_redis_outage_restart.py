"""A worker that starts while Redis is down, and the embedded Redis that dies: real redis-servers, the tiny model."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

from cluster.prefix_index import PrefixIndex
from cluster.redis_client import RedisAuth
from cluster.worker import WorkerSpec
from decode_workers.worker import DecodeWorker
from engine import EngineConfig
from kv_transfer.state import TransferConfig
from pdcluster.redis_server import EmbeddedRedis, _free_port, connect


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


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
        assert (server.port, server.password, server.restarts, server.failure) == (port, password, 1, None)
        assert server.pid != pid
    assert not answers()  # stop() ends the supervision too: nothing restarts it
