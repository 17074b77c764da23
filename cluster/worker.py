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
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from cluster import faults, tracing
from cluster.cores import LEND_MIN_PROMPT_TOKENS, CoreShare
from cluster.leases import RequestLeases
from cluster.messages import DecodeRequest, Delta, Role, WorkerInfo, WorkerLoad
from cluster.outlet import Outlet
from cluster.process import node_address, rss_bytes
from cluster.redis_client import RedisAuth
from cluster.tracing import TracingSettings
from cluster.worker_metrics import PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S, LinearCost, WorkerMetrics
from engine.block_hash import BlockHash
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.loop import EngineLoop
from engine.parallel.launch import TPGroupError
from engine.sequence import Sequence
from kv_transfer.state import TransferConfig

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 0.5
ABORT_MEMORY_S = 120.0  # how long an abort is remembered for a request that has not arrived yet
REGISTER_BACKOFF_S = (0.2, 5.0)  # first and largest wait between registration attempts while Redis is down
LEASE_CHECK_S = 0.5  # how often running requests' leases are checked (cluster/leases.py)
EXIT_ENGINE_FAILED = 70  # the process's exit code when its engine can never step again (EX_SOFTWARE)


class RequestAborted(EngineError):
    """The request was aborted (its client went away) before this worker started it."""


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one worker; the launcher sends it to the worker's Ray actor."""

    name: str  # also the Ray actor name, e.g. "prefill-0"
    role: Role
    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    redis_url: str | None = None  # None: no prefix index (unit tests)
    key_prefix: str = "pdc"
    kv_host: str = "127.0.0.1"  # decode/colocated: where the KV endpoint listens
    log_level: str = "INFO"
    log_format: str = "text"  # or "json"
    redis_auth: RedisAuth | None = None
    cpus: tuple[int, ...] = ()  # pin the actor's process to these cores (empty: not pinned)
    nice: int | None = None  # CPU priority of the actor's process (None: as Ray started it)
    served_model_name: str = ""  # the `model_name` label of this worker's metrics (empty: `model`)
    metrics_host: str = "127.0.0.1"  # where this worker's own /metrics listens
    metrics_port: int | None = None  # its port (0: a free one, advertised in the heartbeat); None: not served
    tracing: TracingSettings = field(default_factory=TracingSettings)
    cores_group: str = ""  # the node's core-lending file of this cluster (cluster/cores.py); empty: not shared
    lend_cores: bool = False  # step on idle peers' cores too (the pool's lend_idle_cores)
    lend_min_tokens: int = LEND_MIN_PROMPT_TOKENS  # ... only for steps with this many prompt tokens left to compute
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, PEFT directory) loaded at start


def join_cores(spec: WorkerSpec) -> CoreShare | None:
    """This worker's slot in its node's core-lending file (cluster/cores.py); None when the cluster shares none."""
    if not spec.cores_group:
        return None
    share = CoreShare.join(spec.cores_group, spec.cpus, spec.engine.threads, lend=spec.lend_cores,
                           min_tokens=spec.lend_min_tokens)
    log.info("%s: core lending: slot %d, own cores %s, %d threads%s", spec.name, share.index,
             list(spec.cpus) or "all", spec.engine.threads, "; steps on idle peers' cores" if spec.lend_cores else "")
    return share


@dataclass
class _Started:
    """When a request arrived on this worker and when the step that first computed it began (monotonic)."""

    seq: Sequence
    arrived: float
    started: float = 0.0


class Superseded(RuntimeError):
    """A newer incarnation of this worker (same name, higher epoch) registered: this one is a zombie."""


class Worker:
    """Engine + loop + prefix-index publishing; subclasses add the request path of their role."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        tracing.configure(spec.tracing, spec.name)
        self.engine = LLMEngine(loaded or load_model(spec.model, device=spec.engine.device, dtype=spec.engine.dtype),
                                spec.engine)
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
        self.index = None
        self.epoch = 0
        if spec.redis_url:
            from cluster.prefix_index import PrefixIndex, heartbeat_key
            from cluster.redis_breaker import RedisBreaker
            from cluster.redis_client import connect

            # NOTE: heartbeats signed with the cluster token: a reader trusts no KV address a stranger wrote
            self.index = PrefixIndex(connect(spec.redis_url, spec.redis_auth), spec.key_prefix,
                                     RedisBreaker(spec.name), heartbeat_key(spec.transfer.cluster_token))
            self.metrics.registry.register(self.index.breaker)
        self._registered = False
        self._register_wait = REGISTER_BACKOFF_S[0]
        self._register_at = 0.0  # monotonic time of the next registration attempt
        # NOTE: one attempt here, so a worker that starts with Redis up answers `info` with its epoch; with Redis
        # down the constructor must not raise (Ray would mark the actor dead for good): the publisher retries
        self._try_register()
        self._resync = False
        self._superseded = False  # a newer incarnation of this worker registered: this one writes no more
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True, name=f"{spec.name}-publisher")
        self._publisher.start()

    @property
    def kv_address(self) -> str:
        return ""

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
            cost, measured = self.step_cost, int(self.step_cost.observed > 0)
        return WorkerLoad(running=s.num_running, paused=s.num_paused, waiting=s.num_waiting, reserved=s.num_reserved,
                          num_blocks=s.num_blocks, free_blocks=s.num_free_blocks, cached_blocks=s.num_cached_blocks,
                          pending_prefill_tokens=pending, prompt_tokens=s.prompt_tokens,
                          cached_prompt_tokens=s.cached_prompt_tokens, rss_bytes=rss_bytes(),
                          spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens,
                          computed_tokens=s.computed_tokens, step_base_us=measured and round(cost.base_s * 1e6),
                          step_token_ns=measured and max(1, round(cost.per_token_s * 1e9)),
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
        self.step_cost.observe(computed - self._computed, time.monotonic() - step_started)
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

    # ---- publishing ---------------------------------------------------------------------------------------
    def _try_register(self) -> bool:
        """Register with the prefix index (a new epoch) once; on failure schedule the next try with backoff."""
        if self.index is None or self._registered:
            return True
        now = time.monotonic()
        if now < self._register_at:
            return False
        try:
            self.epoch = self.index.register_worker(self.name)
        except Exception as e:  # noqa: BLE001 - Redis down or refusing: serve anyway, register later
            if self._register_wait == REGISTER_BACKOFF_S[0]:
                log.warning("%s: cannot register with the prefix index (%s); serving without it, retrying", self.name,
                            e)
            self._register_at = now + self._register_wait
            self._register_wait = min(REGISTER_BACKOFF_S[1], self._register_wait * 2)
            return False
        if self._register_wait != REGISTER_BACKOFF_S[0]:
            log.warning("%s: registered with the prefix index (epoch %d)", self.name, self.epoch)
        self._registered = True
        return True

    def renew_leases(self, request_ids: list[str], lease_s: float) -> None:
        """A live router still wants these requests (cluster/leases.py)."""
        self.leases.renew(request_ids, lease_s)

    def _expire_leases(self) -> None:
        """Abort every running request whose lease no live router renewed (its blocks are freed)."""
        with self.loop.between_steps:
            scheduler = self.engine.scheduler
            running = [seq.request_id for seq in (*scheduler.running, *scheduler.waiting, *scheduler.paused)]
        for rid in self.leases.expired(running):
            log.warning("%s: no live router renewed the lease of %s for %.0f s: aborting it", self.name, rid,
                        self.leases.lease_s or 0.0)
            self.abort(rid, "its router is gone (lease expired)")

    def _publish_loop(self) -> None:
        last_beat, failing, leases_at, beaten = 0.0, False, 0.0, (0, 0, 0)
        while not self._closed.wait(PUBLISH_INTERVAL_S):
            self._check_tp_group()
            if time.monotonic() - leases_at >= LEASE_CHECK_S:
                leases_at = time.monotonic()
                try:
                    self._expire_leases()
                except Exception:  # noqa: BLE001 - a bug here must not stop the heartbeats
                    log.exception("%s: checking request leases failed", self.name)
            if self.index is None or self._superseded:
                continue
            if not self._registered:
                if not self._try_register():
                    continue
                self._resync = True  # NOTE: the whole cache goes to the index (events drained meanwhile are lost)
            with self.loop.between_steps:
                stored, removed = self.engine.block_manager.pool.drain_events()
                if self._resync:
                    stored, removed = self.engine.block_manager.pool.cached_hashes(), []
                hits, self._hits = self._hits, [0, 0]
                s = self.engine.stats()
                members = (s.num_waiting, s.num_running, s.num_reserved)
            now = time.monotonic()
            # NOTE: a beat at least every HEARTBEAT_INTERVAL_S, and at once (within PUBLISH_INTERVAL_S) when requests
            # joined or left the batch: routers (and anyone reading the index) see a new load without waiting
            beat = now - last_beat >= HEARTBEAT_INTERVAL_S or members != beaten
            try:
                self._publish(stored, removed, hits, beat=beat)
            except Superseded as e:
                log.error("%s: %s; this process stops writing to the prefix index", self.name, e)
                self._superseded = True
                continue
            except Exception as e:  # noqa: BLE001 - Redis down: keep serving, resync when it is back
                if not failing:
                    log.warning("%s: prefix index unreachable (%s); will resync", self.name, e)
                failing, self._resync = True, True
                with self.loop.between_steps:
                    self._hits[0] += hits[0]
                    self._hits[1] += hits[1]
                continue
            if failing:
                log.warning("%s: prefix index reachable again; resynced", self.name)
            failing = self._resync = False
            if beat:
                last_beat, beaten = now, members

    def _publish(self, stored: Seq[BlockHash], removed: Seq[BlockHash], hits: list[int], *, beat: bool) -> None:
        assert self.index is not None
        if self._resync:
            # NOTE: events drained while Redis was away are lost; a new epoch drops every entry of the old one
            # (evicted blocks included), and `stored` is then the whole cache
            self._renew_epoch()
        if stored or removed:
            if not self.index.publish(self.name, self.epoch, stored, removed):
                # NOTE: our epoch is no longer current (Redis was emptied): take a new one and republish all
                self._renew_epoch()
                raise RuntimeError("epoch was stale; registered again")
        if hits[0]:
            self.index.count_hits(self.name, hits[0], hits[1])
        if beat and not self.index.heartbeat(self.name, self.epoch, self.spec.role, self.kv_address, self.load(),
                                             metrics_port=self.metrics.port):
            self._renew_epoch()
            raise RuntimeError("heartbeat epoch was stale; registered again")

    def _renew_epoch(self) -> None:
        """A new epoch, unless a newer incarnation of this worker registered since ours (Superseded)."""
        assert self.index is not None
        epoch = self.index.renew_epoch(self.name, self.epoch)
        if epoch is None:
            raise Superseded(f"a newer incarnation of {self.name} registered after our epoch {self.epoch}")
        self.epoch = epoch

    def _engine_failed(self, error: BaseException) -> None:
        """The engine can never step again (a rank of its TP group died): end this process.

        NOTE: a TP group is one worker: half of it must not serve on. Ending the process makes it a dead worker like
        any other: the router fails its requests over (streams resume elsewhere, no token lost or repeated) and Ray
        restarts the actor, which starts a fresh group as a unit (the pool's `max_restarts`). The followers still
        running are killed first (os._exit runs no finalizer; they would leave on their own within a parent poll).
        """
        log.critical("%s: %s; ending this worker's process (exit code %d) so that its requests fail over and Ray "
                     "restarts it", self.name, error, EXIT_ENGINE_FAILED)
        followers = getattr(self.engine.runner, "followers", None)
        if followers is not None:
            followers.kill()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_ENGINE_FAILED)

    def _check_tp_group(self) -> None:
        """End this process if its TP group failed or lost a rank while no step noticed (an idle engine, or a KV
        write into the pool that failed on a receiver's thread): the next request would only fail over anyway."""
        runner = self.engine.runner
        followers = getattr(runner, "followers", None)
        if followers is None or self._closed.is_set():  # NOTE: TP 1; or closing, when the group stops on purpose
            return
        failure = getattr(runner, "failure", None)
        dead = [] if failure is not None else followers.dead()
        if failure is not None or dead:
            self._engine_failed(failure or TPGroupError(f"tensor-parallel group of {len(followers.procs) + 1} lost "
                                                        f"{'; '.join(dead)}"))

    def tp_follower_pids(self) -> list[int]:
        """The pids of this worker's TP follower processes (ranks 1 .. n-1); empty at TP 1."""
        followers = getattr(self.engine.runner, "followers", None)
        return [] if followers is None else [f.process.pid for f in followers.procs if f.process.pid is not None]

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
        if self.index is not None and self._registered:
            try:
                self.index.unregister_worker(self.name, self.epoch)
            except Exception as e:  # noqa: BLE001 - Redis may already be gone at shutdown
                log.info("%s: could not unregister from the prefix index: %s", self.name, e)
