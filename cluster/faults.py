"""Fault injection for tests and `pdcluster bench soak`: a worker whose engine hangs, an actor whose restart is slow.

Both act on the real thing: `hang_loop` holds the worker's engine loop (no step runs, its requests get no token,
and the heartbeat, which reads the load under the same lock, stops; the actor still answers pings), and
`PDC_FAULT_RESTART_DELAY_S` in the launching process's environment (the launcher passes every `PDC_FAULT_*`
variable to the workers) makes an actor that Ray restarts sleep that long first, like a slow model load.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.loop import EngineLoop

log = logging.getLogger(__name__)

RESTART_DELAY_ENV = "PDC_FAULT_RESTART_DELAY_S"


def hang_loop(loop: EngineLoop, name: str, seconds: float) -> threading.Event:
    """Hold `loop` between two steps for `seconds` (on a thread of its own); the event is set once it holds it."""
    begun = threading.Event()

    def hang(engine: object) -> None:
        begun.set()
        log.warning("%s: fault injection: the engine loop hangs for %.1f s", name, seconds)
        time.sleep(seconds)
    threading.Thread(target=loop.call, args=(hang,), daemon=True, name=f"{name}-hang").start()
    return begun


def delay_restart(name: str) -> None:
    """In a Ray actor's constructor: sleep RESTART_DELAY_ENV seconds if Ray is restarting this actor."""
    delay = float(os.environ.get(RESTART_DELAY_ENV) or 0)
    if delay <= 0:
        return
    import ray

    if ray.get_runtime_context().was_current_actor_reconstructed:
        log.warning("%s: fault injection: restart delayed by %.1f s (%s)", name, delay, RESTART_DELAY_ENV)
        time.sleep(delay)
