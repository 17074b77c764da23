"""The Ray actor of a decode (or colocated) worker: a thin wrapper over `DecodeWorker` (named `decode-N`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

from decode_workers.worker import DecodeWorker
from pdcluster import logs
from pdcluster.messages import DecodeRequest, Delta, WorkerInfo
from pdcluster.worker import WorkerSpec


@ray.remote
class DecodeActor:
    """Ray face of one DecodeWorker; `generate` is a streaming generator (call it with num_returns="streaming")."""

    def __init__(self, spec: WorkerSpec) -> None:
        logs.configure(spec.name, spec.log_level, spec.log_format)
        self.worker = DecodeWorker(spec)

    async def info(self) -> WorkerInfo:
        return self.worker.info()

    async def load(self) -> dict[str, float]:
        return self.worker.load()

    async def generate(self, req: DecodeRequest) -> AsyncIterator[Delta]:
        async for delta in self.worker.generate(req):
            yield delta

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.worker.abort, request_id)  # NOTE: off the event loop (waits for a step)

    async def close(self) -> None:
        self.worker.close()
