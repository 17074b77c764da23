"""What every worker shares: the engine on its loop, the prefix-index publisher, heartbeats and hit counters.

Life of a worker:
1. load the model, build the engine and its loop, register with the prefix index (a new epoch: entries of a
   previous life of this worker name are purged); with Redis down the worker starts anyway and the publisher
   thread registers it, retrying with backoff, once Redis is back (a restart during an outage must not fail);
2. a publisher thread sends the prefix cache's stored/evicted block events, prefix-hit counts and a heartbeat
   with the load (and the port of this worker's own /metrics, cluster/worker_metrics.py) to Redis, off the request
   path; a Redis outage is logged and the index resynced when it is back;
3. the subclasses (prefill, decode/colocated) take requests; a request whose lease no live router renews is aborted
   (cluster/leases.py: a router killed with `kill -9` leaves nothing running);
4. `close()` unregisters and stops everything.

The parts that live beside it: `WorkerSpec` (cluster/worker_spec.py), the prefix-index registration, publisher thread
and leases (`IndexMember`, the base class: cluster/worker_publisher.py), a failed TP group (cluster/tp_group.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from cluster import faults, tp_group, tp_ranks, tracing
from cluster.leases import RequestLeases
from cluster.messages import DecodeRequest, Delta, WorkerInfo, WorkerLoad
from cluster.outlet import Outlet
from cluster.process import node_address, rss_bytes
from cluster.worker_metrics import PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S, LinearCost, WorkerMetrics
from cluster.worker_publisher import IndexMember
from cluster.worker_spec import WorkerSpec, join_cores  # NOTE: WorkerSpec's importers take it from here too
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.loop import EngineLoop
from engine.sequence import Sequence

log = logging.getLogger(__name__)

ABORT_MEMORY_S = 120.0  # how long an abort is remembered for a request that has not arrived yet


class RequestAborted(EngineError):
    """The request was aborted (its client went away) before this worker started it."""


@dataclass
class _Started:
    """When a request arrived on this worker and when the step that first computed it began (monotonic)."""

    seq: Sequence
    arrived: float
    started: float = 0.0


class Worker(IndexMember):
    """Engine + loop + prefix-index publishing; subclasses add the request path of their role."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        tracing.configure(spec.tracing, spec.name)
        # NOTE: a TP worker of a cluster hosts its ranks 1 .. n-1 in Ray actors of its placement group
        ranks = tp_ranks.launcher(tp_ranks.RankHost.of(spec)) if spec.placement_group else None
        self.engine = LLMEngine(loaded or load_model(spec.model, device=spec.engine.device, dtype=spec.engine.dtype),
                                spec.engine, launch_followers=ranks)
        self.engine.warm_up()  # NOTE: before the step-cost fit and the prefix-cache events exist
        for lora_name, lora_path in spec.lora_modules:  # NOTE: a bad adapter fails the start, naming it
            self.engine.load_lora(lora_name, lora_path)
        self.engine.block_manager.pool.enable_events()
        self._starting: dict[str, _Started] = {}
        self._outlets: dict[asyncio.AbstractEventLoop, Outlet] = {}  # the actor's loop (tests may run several)
        self._outlet_lock = threading.Lock()
        self.cores = join_cores(spec)
        self.loop = EngineLoop(self.engine, name=spec.name, on_step=self._on_step,
                               before_step=self._before_step if self.cores else None,
                               on_idle=self.cores.idle if self.cores else None, after_outputs=self._flush_outlet,
                               on_fatal=self._engine_failed)
        self.step_cost = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)  # what the router predicts with
        self._computed = 0  # engine's computed tokens after the last step
        self._hits = [0, 0]  # prompt tokens requested, served from cache: not yet counted in Redis
        self._aborted: dict[str, float] = {}  # request id → when an abort for it came (under the loop lock)
        self._closed = threading.Event()
        self.leases = RequestLeases()  # NOTE: on once a router renews; a dead router's requests are aborted
        self.metrics = WorkerMetrics(spec.served_model_name or spec.model, self.load,
                                     self._adapters if self.engine.lora is not None else None)
        if spec.metrics_port is not None:
            host = node_address(spec.metrics_host)
            port = self.metrics.serve(host, spec.metrics_port)
            log.info("%s: metrics on http://%s:%d/metrics", spec.name, host, port)
        self._join_index()

    def outlet(self, aio: asyncio.AbstractEventLoop) -> Outlet:
        """The one Outlet from this worker's engine thread into `aio` (the actor's event loop)."""
        with self._outlet_lock:
            for gone in [loop for loop in self._outlets if loop.is_closed()]:
                del self._outlets[gone]
            if aio not in self._outlets:
                self._outlets[aio] = Outlet(aio)
            return self._outlets[aio]

    def _flush_outlet(self) -> None:
        """The engine loop's `after_outputs`: what the step's sinks queued goes to the event loop(s) now."""
        for outlet in list(self._outlets.values()):
            outlet.flush()

    def generate(self, req: DecodeRequest) -> AsyncGenerator[Delta, None]:
        """The request's deltas from this worker's engine (each pool's worker says how it takes the request)."""
        raise NotImplementedError

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.name, self.spec.role, self.epoch, e.model_config.model_id, e.scope,
                          e.config.block_size, e.block_manager.pool.num_blocks, e.max_model_len,
                          e.model_config.vocab_size, e.config.max_num_seqs, e.tokenizer.to_json(), self.kv_address,
                          {} if e.lora is None else e.lora.keys())

    def load(self) -> WorkerLoad:
        """The heartbeat's numbers: what the router weighs when it picks a worker."""
        with self.loop.between_steps:
            s = self.engine.stats()
            pending = sum(len(st.seq) - st.seq.num_computed_tokens for st in self._starting.values())
            cost = self.step_cost.heartbeat()
        return WorkerLoad(running=s.num_running, paused=s.num_paused, waiting=s.num_waiting, reserved=s.num_reserved,
                          num_blocks=s.num_blocks, free_blocks=s.num_free_blocks, cached_blocks=s.num_cached_blocks,
                          pending_prefill_tokens=pending, prompt_tokens=s.prompt_tokens,
                          cached_prompt_tokens=s.cached_prompt_tokens, rss_bytes=rss_bytes(),
                          spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens,
                          computed_tokens=s.computed_tokens, **cost,
                          max_num_batched_tokens=self.engine.config.max_num_batched_tokens,
                          shortest_first=int(self.engine.config.prefill_order == "shortest_first"))

    def _adapters(self) -> tuple[int, list[str], list[str]]:
        """max_loras and the LoRA adapters of the running and the waiting requests (vllm:lora_requests_info)."""
        with self.loop.between_steps:
            running, waiting = ([q.params.lora for q in seqs if q.params.lora]
                                for seqs in (self.engine.scheduler.running, self.engine.scheduler.waiting))
        return self.engine.config.max_loras, sorted(set(running)), sorted(set(waiting))

    # ---- request timing and hit counting (called under the loop lock) --------------------------------------
    def _track(self, seq: Sequence, arrived: float) -> None:
        self._starting[seq.request_id] = _Started(seq, arrived)

    def _before_step(self) -> None:
        assert self.cores is not None
        # NOTE: every step: the scheduler's sum is taken only where it decides something
        self.cores.before_step(self.engine.scheduler.pending_prompt_tokens() if self.cores.lend else 0)

    def _on_step(self, step_started: float) -> None:
        computed = self.engine.stats().computed_tokens
        took = time.monotonic() - step_started
        self.step_cost.observe(computed - self._computed, took)
        self.metrics.step.observe(took)
        self._computed = computed
        # NOTE: the engine's ITL budget follows the same measured cost the router predicts with
        self.engine.scheduler.budget.set_cost(self.step_cost.base_s, self.step_cost.per_token_s)
        for st in self._starting.values():
            # NOTE: a request that finished in this very step has already given its blocks back (0 computed)
            if not st.started and (st.seq.num_computed_tokens > 0 or st.seq.num_output_tokens > 0):
                st.started = step_started

    def _first_token(self, request_id: str, now: float) -> tuple[float, float]:
        """Queue and prefill time (ms) of a request that just got its first token; counts its prefix hits."""
        st = self._starting.pop(request_id, None)
        if st is None:
            return 0.0, 0.0
        self._hits[0] += st.seq.num_prompt_tokens
        self._hits[1] += st.seq.num_cached_tokens
        started = st.started or now
        self.metrics.first_token(started - st.arrived, now - started)
        return (started - st.arrived) * 1e3, (now - started) * 1e3

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request here and free what it holds (each pool knows what that is)."""
        raise NotImplementedError

    def _forget(self, request_id: str) -> None:
        self._starting.pop(request_id, None)

    def _remember_abort(self, request_id: str) -> None:
        """Note an abort, so the request is refused if it arrives only now (called under the loop lock).

        NOTE: Ray runs the calls of an async actor concurrently, in no guaranteed order: the router's abort may
        overtake the call it aborts.
        """
        now = time.monotonic()
        self._forget(request_id)
        self._aborted[request_id] = now
        for rid in [r for r, t in self._aborted.items() if now - t > ABORT_MEMORY_S]:
            del self._aborted[rid]

    def _check_not_aborted(self, request_id: str) -> None:
        if self._aborted.pop(request_id, None) is not None:
            raise RequestAborted("the request was aborted before it reached this worker", request_id)

    def _engine_failed(self, error: BaseException) -> None:
        """The engine can never step again (a rank of its TP group died): end this process (cluster/tp_group.py)."""
        tp_group.end_process(self.name, error, self.engine.runner)

    def tp_follower_pids(self) -> list[int]:
        """The pids of this worker's TP followers (ranks 1 .. n-1: Ray actors, or processes); empty at TP 1."""
        return tp_group.follower_pids(self.engine.runner)

    def tp_ranks(self) -> list[tp_ranks.RankPlace]:
        """Where this worker's TP rank actors run (ranks 1 .. n-1); empty at TP 1 or when they are processes."""
        group = tp_group.followers(self.engine.runner)
        return [] if group is None else tp_ranks.places(group)

    def debug_hang(self, seconds: float) -> threading.Event:
        """Fault injection (tests, `bench soak --hang-at`): the engine loop hangs for `seconds` (cluster/faults.py)."""
        return faults.hang_loop(self.loop, self.name, seconds)

    def close(self) -> None:
        self._closed.set()
        self._publisher.join(timeout=2)
        self.loop.close()
        self.engine.close()  # NOTE: a TP group's followers stop with it
        if self.cores is not None:
            self.cores.leave()
        self.metrics.close()
        tracing.flush()
        self._leave_index()
