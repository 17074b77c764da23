"""The router process's event loop (`router.event_loop`): uvloop where it is installed, else asyncio's own.

uvloop (libuv under asyncio's API) runs the loop's own work (each round's poll, the ready callbacks, socket reads
and writes, timers) in C: at a GPU's token rate that work, once per token per stream, is much of the router's CPU
(`pdcluster bench path` measures it both ways). vLLM's and SGLang's servers run on it; uvicorn's `--loop
auto|uvloop|asyncio` is the same choice as this one. "auto" falls back to asyncio where uvloop is not installed
(an image that carries only some wheels, a platform it does not build for).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from pdcluster.router_config import EventLoop
from pdcluster.security import SetupError

T = TypeVar("T")


class EventLoopError(SetupError):
    """The event loop the config names cannot be had here."""


def resolve(choice: EventLoop) -> Literal["uvloop", "asyncio"]:
    """The loop `choice` gives on this machine: "uvloop" or "asyncio"; EventLoopError for "uvloop" without it."""
    if choice == "asyncio":
        return "asyncio"
    try:
        importlib.import_module("uvloop")
    except ImportError as e:
        if choice == "uvloop":
            raise EventLoopError(f"router.event_loop is uvloop, but uvloop cannot be imported here ({e}): "
                                 "pip install uvloop, or set it to auto or asyncio") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], choice: EventLoop = "auto") -> T:
    """`asyncio.run(main)` on a loop of `choice` (see `resolve`)."""
    if resolve(choice) == "uvloop":
        return importlib.import_module("uvloop").run(main)  # type: ignore[no-any-return]
    return asyncio.run(main)
