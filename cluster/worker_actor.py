"""WorkerActor: what both pools' Ray actors share, over their plain worker (prefill_workers/actor.py,
decode_workers/actor.py add their request methods and are wrapped by `ray.remote`).

A request's deltas (and a prefill worker's first token) reach the router one of two ways: over the worker's delta
channel (cluster/delta_server.py: one connection per router, a step's deltas as one message), which routers use
whenever `stream_endpoint()` offers one, or through Ray (`generate(req)`: a streaming generator, one Ray object
per delta; `prefill(req)`) where it does not (a KV plane with TLS: everything then travels inside Ray's own
transport, which the operator secures).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster import faults
from cluster.delta_server import DeltaServer, Handler
from cluster.messages import WorkerInfo, WorkerLoad
from cluster.process import node_address, pin_cpus, process_info, set_nice
from cluster.worker_spec import WorkerSpec

if TYPE_CHECKING:
    # NOTE: the worker (engine, torch) is imported by the actor's constructor, in its own process: the router's
    # process imports this module for the actor class only
    from cluster.worker import Worker

GIL_SWITCH_S = 0.0005  # the worker process's GIL switch interval


class WorkerActor:
    """What both pools' Ray actors share (subclasses add their request method and are wrapped by `ray.remote`).

    Every method is async, so calls run concurrently on the actor's event loop; anything that waits for the
    engine lock (held for a whole step) runs in a thread.
    """

    worker: Worker

    def _configure(self, spec: WorkerSpec) -> None:
        from cluster import logs

        logs.configure(spec.name, spec.log_level, spec.log_format)
        # NOTE: the engine thread takes the GIL back after each torch op; a thread holding it (the event loop sending
        # deltas, the publisher) keeps it up to the switch interval: 5 ms by default, on a 20 ms step
        sys.setswitchinterval(GIL_SWITCH_S)
        if spec.cpus:
            pin_cpus(spec.cpus)
        if spec.nice is not None:
            set_nice(spec.nice)
        faults.delay_restart(spec.name)

    _streams: DeltaServer | None = None

    async def stream_endpoint(self) -> tuple[str, str]:
        """(host:port, secret) of this worker's delta channel; ("", "") when it has none (stream through Ray)."""
        spec = self.worker.spec
        if spec.transfer.tls is not None:  # NOTE: the channel is cleartext: with TLS the deltas stay inside Ray
            return "", ""
        if self._streams is None:
            self._streams = DeltaServer(node_address(spec.kv_host), self.channel_handlers())
        return await self._streams.endpoint()

    def channel_handlers(self) -> dict[str, Handler]:
        """What a router may open over the delta channel: `generate` (a stream of Deltas) on every worker."""
        return {"generate": self.worker.generate}

    async def ping(self) -> int:
        """The worker's epoch, from the actor's event loop: it answers at once while the actor is up."""
        return self.worker.epoch

    async def info(self) -> WorkerInfo:
        return self.worker.info()

    async def process(self) -> dict[str, object]:
        """This actor's process: pid, cores, nice values of its threads, torch threads (cluster/worker.process_info),
        its TP ranks, its KV transport."""
        # NOTE: from a fresh thread, as the engine loop's own: its OpenMP pool size is the one such a thread gets
        info = await asyncio.to_thread(process_info)
        if self.worker.cores is not None:
            info["lent_steps"] = self.worker.cores.lent_steps  # steps run on idle peers' cores (cluster/cores.py)
        info["tp_follower_pids"] = self.worker.tp_follower_pids()  # ranks 1 .. n-1 of its TP group (empty at TP 1)
        info["tp_ranks"] = self.worker.tp_ranks()  # ... where Ray placed them (cluster/tp_ranks.py RankPlace)
        info["kv_transport"] = self.worker.spec.transfer.transport  # what its KV moves over (nixl may give way)
        return info

    async def load(self) -> WorkerLoad:
        return self.worker.load()

    async def renew_leases(self, request_ids: list[str], lease_s: float) -> None:
        """A router's one renewal per period for all its requests in flight (router/leases.py)."""
        self.worker.renew_leases(request_ids, lease_s)

    async def prove_token(self, nonce: bytes) -> bytes:
        """HMAC of `nonce` with this worker's cluster token: a `serve` re-attaches only to workers of its cluster."""
        import hashlib
        import hmac

        return hmac.new(self.worker.spec.transfer.cluster_token.encode(), b"pdcluster attach " + nonce,
                        hashlib.sha256).digest()

    async def heartbeat_key(self) -> bytes | None:
        """The key this worker signs its heartbeats with (an extra router checks them with it)."""
        from cluster.prefix_index import heartbeat_key

        return heartbeat_key(self.worker.spec.transfer.cluster_token)

    async def load_lora(self, name: str, path: str) -> tuple[str, str]:
        """Load the PEFT adapter at `path` as `name`: (its block-hash key, "") or ("", what is wrong with it).

        NOTE: the reason as a value, not an exception through Ray: the router reports it to the operator as it is,
        and the worker serves on (a refused adapter changes nothing here).
        """
        return await asyncio.to_thread(self._lora, lambda: self.worker.engine.load_lora(name, path), name)

    async def unload_lora(self, name: str) -> tuple[str, str]:
        """Unload adapter `name`: ("", "") or ("", why not: unknown, or requests still use it)."""
        return await asyncio.to_thread(self._lora, lambda: self.worker.engine.unload_lora(name), "")

    def _lora(self, change: Callable[[], None], name: str) -> tuple[str, str]:
        from engine.errors import EngineError

        try:
            with self.worker.loop.between_steps:  # NOTE: the slots' weights change only between steps
                change()
                return (self.worker.engine.lora.keys().get(name, "") if self.worker.engine.lora else ""), ""
        except EngineError as e:
            return "", str(e)

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.worker.abort, request_id)

    async def debug_hang(self, seconds: float) -> None:
        """Fault injection: the engine loop hangs for `seconds` (returns once it has begun; see Worker.debug_hang)."""
        await asyncio.to_thread(self.worker.debug_hang(seconds).wait, 30.0)

    async def close(self) -> None:
        if self._streams is not None:
            self._streams.close()
        self.worker.close()
