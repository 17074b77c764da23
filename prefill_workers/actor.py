"""The Ray actor of a prefill worker: a thin wrapper over `PrefillWorker` (named `prefill-N`, namespace pdcluster)."""

from __future__ import annotations

import asyncio

import ray

from pdcluster import logs
from pdcluster.messages import PrefillRequest, PrefillResult, WorkerInfo
from pdcluster.worker import WorkerSpec
from prefill_workers.worker import PrefillWorker


@ray.remote
class PrefillActor:
    """Ray face of one PrefillWorker; every method is async so calls run concurrently on the actor's event loop."""

    def __init__(self, spec: WorkerSpec) -> None:
        logs.configure(spec.name, spec.log_level, spec.log_format)
        self.worker = PrefillWorker(spec)

    async def info(self) -> WorkerInfo:
        return self.worker.info()

    async def load(self) -> dict[str, float]:
        return self.worker.load()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.worker.abort, request_id)  # NOTE: off the event loop (waits for a step)

    async def close(self) -> None:
        self.worker.close()
