"""`router.event_loop`: the router process's loop is uvloop where it is installed ("auto"), asyncio's when asked, and
a config that asks for uvloop where it cannot be imported is refused before anything starts."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pdcluster import event_loop, serve
from pdcluster.config import ClusterConfig
from pdcluster.security import SetupError


async def _loop_module() -> str:
    await asyncio.sleep(0.001)  # NOTE: a timer and a round of the loop, not only a first step
    return type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_asyncios_loop():
    pytest.importorskip("uvloop")
    assert event_loop.resolve("auto") == event_loop.resolve("uvloop") == "uvloop"
    assert event_loop.run(_loop_module(), "auto").startswith("uvloop")
    assert event_loop.run(_loop_module(), "uvloop").startswith("uvloop")
    assert event_loop.resolve("asyncio") == "asyncio"
    assert event_loop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_setup_error_naming_the_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # NOTE: `import uvloop` raises ImportError, as where it is absent
    assert event_loop.resolve("auto") == "asyncio"
    assert event_loop.run(_loop_module(), "auto").startswith("asyncio")
    with pytest.raises(SetupError, match="router.event_loop is uvloop"):
        event_loop.resolve("uvloop")


def test_serve_refuses_an_event_loop_it_cannot_have_before_starting_anything(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)
    config = ClusterConfig.model_validate({"model": "tiny", "router": {"event_loop": "uvloop"}})
    started = []
    monkeypatch.setattr(serve, "Cluster", lambda *a, **k: started.append(a))
    with pytest.raises(SetupError, match="uvloop"):
        serve.run(config)
    assert not started  # NOTE: no Ray, no Redis, no worker


def test_the_config_names_a_bad_event_loop():
    with pytest.raises(ValueError, match="event_loop"):
        ClusterConfig.model_validate({"model": "tiny", "router": {"event_loop": "trio"}})
