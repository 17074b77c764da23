"""Pools resized while serving, without Ray: a router over fake actor handles, a launcher that makes more of them,
and the real prefix index (an embedded Redis) for what a lost worker leaves behind.

What a user would notice: a new worker takes requests only after its warm-up, a draining worker gets no new request
and leaves only once its running ones are done (then it is stopped and its entries unregistered), a lost worker is
routed around at once and its index entries purged, and bad targets are refused naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.messages import DecodeRequest, Role
from cluster.prefix_index import PrefixIndex
from engine.errors import InvalidRequestError
from pdcluster.redis_server import EmbeddedRedis, connect
from router.core import Router
from router.scaling import PoolScaler
from router.settings import RouterSettings
from tests.test_router_flow import FakeActor, Remote, handle


class ActorDiedError(Exception):
    """Named as Ray's: the scaler tells errors apart by name (the router does not import ray)."""


class ActorUnavailableError(Exception):
    """Named as Ray's."""


class Member(FakeActor):
    """A fake worker that also answers (or fails) pings."""

    def __init__(self) -> None:
        super().__init__()
        self.ping_error: type[Exception] | None = None
        self.ping = Remote(self._ping)

    async def _ping(self) -> int:
        if self.ping_error is not None:
            raise self.ping_error("no answer")
        return 1


class Launcher:
    """Starts fake workers (named as pdcluster.launch.Cluster names them) and records the stops."""

    def __init__(self) -> None:
        self.actors: dict[str, Member] = {}
        self.stopped: list[str] = []

    def start_worker(self, role: Role) -> Any:
        index = sum(n.startswith(f"{role}-") for n in self.actors) + 10
        name = f"{role}-{index}"
        self.actors[name] = Member()
        return handle(name, role, self.actors[name])

    def stop_worker(self, name: str) -> None:
        self.stopped.append(name)


def router_of(prefill: int, decode: int, index: Any = None) -> tuple[Router, dict[str, Member]]:
    actors = {f"prefill-{i}": Member() for i in range(prefill)} | {f"decode-{i}": Member() for i in range(decode)}
    handles = [handle(n, Role.PREFILL if n.startswith("prefill") else Role.DECODE, a) for n, a in actors.items()]
    return Router(handles, index, RouterSettings(model="fake", mode="disaggregated")), actors


def test_a_new_worker_warms_up_then_takes_requests():
    router, _ = router_of(1, 1)
    launcher = Launcher()
    scaler = PoolScaler(router, launcher)
    result = asyncio.run(scaler.scale(prefill=2, decode=2))
    assert (result.prefill, result.decode, sorted(result.added)) == (2, 2, ["decode-10", "prefill-10"])
    warm = launcher.actors["decode-10"].requests  # one 1-token request ran before it joined
    assert len(warm) == 1 and isinstance(warm[0], DecodeRequest) and warm[0].params.max_tokens == 1
    assert launcher.actors["prefill-10"].calls == 1  # its warm-up prefill
    picked = {router.pools.route(40, 8, {}).decode for _ in range(8)}
    assert "decode-10" in picked


def test_a_draining_worker_takes_nothing_new_and_leaves_when_idle():
    router, _ = router_of(1, 2)
    launcher = Launcher()
    scaler = PoolScaler(router, launcher, drain_timeout_s=30)
    busy = router.pools["decode-1"]
    router.pools["decode-0"].view.inflight = 3  # busier: decode-1 is the one to drain
    busy.view.inflight = 1

    async def run() -> Any:
        task = asyncio.create_task(scaler.scale(decode=1))
        await asyncio.sleep(1.5)
        assert not task.done() and "decode-1" in router.pools.by_name  # waits for its running request
        assert {router.pools.route(40, 8, {}).decode for _ in range(8)} == {"decode-0"}  # nothing new goes there
        busy.view.inflight = 0  # the request finished
        return await asyncio.wait_for(task, 10)
    result = asyncio.run(run())
    assert (result.decode, result.removed, launcher.stopped) == (1, ["decode-1"], ["decode-1"])
    assert "decode-1" not in router.pools.by_name and router.pools["decode-1"] is busy  # runs still find it


@pytest.mark.parametrize("prefill, decode, mode, field", [
    (None, 0, "disaggregated", "decode"), (0, None, "disaggregated", "prefill"),
    (2000, None, "disaggregated", "prefill"), (1, 1, "colocated", "prefill")])
def test_bad_targets_are_refused_naming_the_field(prefill, decode, mode, field):
    router, _ = router_of(1, 1)
    router.settings.mode = mode
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(PoolScaler(router, Launcher()).scale(prefill=prefill, decode=decode))
    assert e.value.field == field


def test_an_extra_router_cannot_scale():
    router, _ = router_of(1, 1)
    with pytest.raises(InvalidRequestError):
        asyncio.run(PoolScaler(router, None).scale(decode=2))


def test_a_lost_worker_is_routed_around_at_once_and_purged_from_the_index():
    with EmbeddedRedis() as server:
        client = connect(server.url)
        index = PrefixIndex(client, "t")
        epoch = index.register_worker("decode-1")
        index.publish("decode-1", epoch, [b"\x01" * 32, b"\x02" * 32], [])
        router, actors = router_of(1, 2, index)
        scaler = PoolScaler(router, Launcher())

        async def ping_round() -> None:  # one round of the router's ping loop, the scaler listening
            scaler.start_watch()
            router.pinger.close()  # NOTE: the test drives the rounds itself
            await router.pinger.round()

        actors["decode-1"].ping_error = ActorUnavailableError  # its node is gone: held at the first ping
        asyncio.run(ping_round())
        assert {router.pools.route(40, 8, {}).decode for _ in range(8)} == {"decode-0"}
        actors["decode-1"].ping_error = None  # it was only a blip: back in the pool
        asyncio.run(ping_round())
        assert "decode-1" in {router.pools.route(40, 8, {}).decode for _ in range(8)}
        actors["decode-1"].ping_error = ActorDiedError  # dead for good: removed and purged
        asyncio.run(ping_round())
        assert "decode-1" not in router.pools.by_name and scaler.lost == ["decode-1"]
        assert index.lookup([b"\x01" * 32]) == {} and not client.exists("t:wblk:decode-1")
        actors["decode-0"].ping_error = ActorDiedError  # the last decode worker is never removed
        asyncio.run(ping_round())
        assert "decode-0" in router.pools.by_name
