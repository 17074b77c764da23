"""The Ray actor of a prefill worker: a thin wrapper over `PrefillWorker` (named `prefill-N`, namespace pdcluster)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray

from cluster.delta_server import Handler
from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult
from cluster.worker_actor import WorkerActor
from cluster.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from prefill_workers.worker import PrefillWorker


@ray.remote
class PrefillActor(WorkerActor):
    """Ray face of one PrefillWorker; `generate` (a request kept here whole) streams: num_returns="streaming"."""

    def __init__(self, spec: WorkerSpec) -> None:
        # NOTE: imported here, in the actor's process: the router's process imports this module for the class
        from prefill_workers.worker import PrefillWorker

        self._configure(spec)
        self.worker: PrefillWorker = PrefillWorker(spec)

    def channel_handlers(self) -> dict[str, Handler]:
        return {**super().channel_handlers(), "prefill": self.worker.prefill_stream}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[Delta]:
        async with contextlib.aclosing(self.worker.generate(req)) as deltas:  # NOTE: closed now when we are
            async for delta in deltas:
                yield delta
