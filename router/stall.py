"""Failover helpers of a RequestRun: how long a decode stream may go without a token, and waiting for a worker.

NOTE: a worker that dies fails its streams at once (Ray reports the death), but one whose engine hangs would hold
them until the request's deadline: a stream with no token for `stall_steps` times the worker's usual time between
tokens (and at least `stall_min_s`) is failed over like a death. A failover whose only choice is a worker that is
restarting waits for it to answer again, until the request's deadline, instead of spending its tries on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_STEP_S = 0.1  # a worker's time between tokens until one was measured
PING_TIMEOUT_S = 2.0  # one liveness probe of a worker while waiting for it
PROBE_EVERY_S = 0.5


@dataclass
class StallClock:
    """Per decode worker, the usual time per token of one stream (EMA), and the stall timeout from it."""

    stall_steps: float = 100.0  # no token for this many usual steps: the stream is stalled
    stall_min_s: float = 15.0  # ... and never less than this (a long prefill step in the same batch is normal)
    step_s: dict[str, float] = field(default_factory=dict)

    def timeout(self, worker: str, tokens: int = 1) -> float:
        """How long a stream of `worker` may go without a delta of `tokens` tokens (its `stream_interval`)."""
        return max(self.stall_min_s, self.stall_steps * tokens * self.step_s.get(worker, DEFAULT_STEP_S))

    def observe(self, worker: str, gap_s: float) -> None:
        """A delta came `gap_s` after the previous one of the same stream."""
        prev = self.step_s.get(worker)
        self.step_s[worker] = gap_s if prev is None else 0.9 * prev + 0.1 * gap_s


class Stalled(Exception):
    """A decode stream produced no token within its stall timeout."""


async def wait_alive(actor: Any, name: str, deadline: float) -> bool:
    """Wait until `actor` answers a ping (a restart done), until `deadline` (monotonic); whether it answered."""
    started, tries, died = time.monotonic(), 0, 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("%s did not come back within the request's deadline (%.0f s waited)", name,
                        time.monotonic() - started)
            return False
        tries += 1
        try:
            await asyncio.wait_for(actor.ping.remote(), min(PING_TIMEOUT_S, left))
            if tries > 1:
                log.info("%s answers again after %.1f s", name, time.monotonic() - started)
            return True
        except Exception as e:  # noqa: BLE001 - restarting (unavailable, or the call waits): probe again
            # NOTE: Ray answers a restarting actor's calls with ActorUnavailableError and a dead one's (no restarts
            # left) with ActorDiedError; twice in a row, so that a ping racing the death itself is not taken for it
            died = died + 1 if type(e).__name__ == "ActorDiedError" else 0
            if died >= 2:
                log.warning("%s is dead and will not restart", name)
                return False
            await asyncio.sleep(min(PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))
