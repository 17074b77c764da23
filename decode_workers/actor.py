"""The Ray actor of a decode (or colocated) worker: a thin wrapper over `DecodeWorker` (named `decode-N`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray

from cluster.messages import DecodeRequest, Delta
from cluster.worker_actor import WorkerActor
from cluster.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from decode_workers.worker import DecodeWorker


@ray.remote
class DecodeActor(WorkerActor):
    """Ray face of one DecodeWorker; `generate` is a streaming generator (call it with num_returns="streaming")."""

    def __init__(self, spec: WorkerSpec) -> None:
        # NOTE: imported here, in the actor's process: the router's process imports this module for the class
        from decode_workers.worker import DecodeWorker

        self._configure(spec)
        self.worker: DecodeWorker = DecodeWorker(spec)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[Delta]:
        async with contextlib.aclosing(self.worker.generate(req)) as deltas:  # NOTE: closed now when we are
            async for delta in deltas:
                yield delta
