"""Discrete-event simulation of a whole cluster: sessions, the router, prefill and decode workers, KV transfers.

Life of a simulated request (the real one's, see router/flow.py and the workers' docstrings):
1. the client sends a session's turn (at its Poisson arrival, or `think_s` after the previous answer arrived);
   the router picks workers with the real policy (`sim_router`); `router_s` later the worker has it;
2. disaggregated: the decode worker reserves blocks for the prompt's KV (linking what it caches), the prefill worker
   computes the prompt in its batch; the KV leaves layer by layer during the last step and its tail lands
   `TransferModel.tail_s` after; the first token reaches the client `result_s` later, and `decode_call_s` after
   that the decode worker takes the request into its batch;
   colocated (or prefill skipped): the decode worker computes the prompt itself, mixed with its decode steps, in
   chunks under its ITL budget; the router's placements (router/policy.py) come with it: a prompt the decode worker
   caches ("prefix"), one the prefill pool's queue would delay more ("slo"), and a whole request kept on a prefill
   worker when the decode pool's steps are the bottleneck ("stay");
3. every decode step's tokens reach the client `token_s` after the step; the last one finishes the request.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.config import DEFAULT_KV_CACHE_GB
from engine.step_budget import StepBudget
from pdcluster.bench.workloads import Session, Workload
from pdcluster.config import ClusterConfig
from pdcluster.plan.profile import Profile
from pdcluster.plan.sim_cache import BlockCache, block_keys
from pdcluster.plan.sim_cores import core_groups
from pdcluster.plan.sim_router import Pool, SimRouter
from pdcluster.plan.sim_worker import Job, Req, Worker, answer_tokens
from router.settings import RouterSettings

DEFAULT_MODEL_LEN = 8192


class Overheads(BaseModel):
    """Costs outside the engine steps (seconds); what the cluster adds to the profile's step times."""

    model_config = ConfigDict(extra="forbid")

    router_s: float = Field(default=0.0, ge=0, description="client sends -> the worker queues the prompt "
                                                          "(validation, prefix lookup, Ray call, KV handshake)")
    result_s: float = Field(default=0.0, ge=0, description="prefill result -> first token at the client")
    decode_call_s: float = Field(default=0.0, ge=0, description="first token at the client -> decode worker "
                                                               "takes the request")
    token_s: float = Field(default=0.0, ge=0, description="a step's tokens -> the client")
    step_extra_s: float = Field(default=0.0, ge=0, description="added to every step")
    step_scale: float = Field(default=1.0, gt=0, description="multiplies every step (a worker sharing its core)")
    calibrated_from: str = Field(default="", description="the run these were fitted to, if any")


GPU_OVERHEADS = Overheads(router_s=0.002, result_s=0.001, decode_call_s=0.001, token_s=0.0005)


@dataclass(frozen=True)
class PoolShape:
    """What the simulator needs of one pool."""

    replicas: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_order: str = "fcfs"
    cpu_affinity: tuple[tuple[int, ...], ...] = ()  # actor i: entry i mod len (empty: not pinned)


@dataclass(frozen=True)
class ClusterShape:
    """Mode, routing and pools of a cluster."""

    mode: str
    routing: str
    skip_max: int
    pools: dict[str, PoolShape]
    # the router's targets (router.slo_itl_ms, slo_ttft_ms): the engines' ITL budget and TTFT bound, and the
    # router's SLO placements in disaggregated mode; None: off
    slo_itl_ms: float | None = None
    slo_ttft_ms: float | None = None

    @classmethod
    def from_config(cls, cfg: ClusterConfig, profile: Profile) -> ClusterShape:
        pools = {}
        for role, p in cfg.pools().items():
            model_len = p.max_model_len or DEFAULT_MODEL_LEN
            # NOTE: as LLMEngine sizes its pool: explicit blocks win; else memory, capped at max_num_seqs full seqs
            usable = p.max_num_seqs * -(-model_len // p.block_size)
            gb = p.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB  # NOTE: a cuda pool sized by its GPU share: not known here
            by_mem = int(gb * 2**30 // (profile.kv_bytes_per_token * p.block_size))
            blocks = p.num_kv_blocks or max(1, min(usable, by_mem))
            if p.max_num_seqs > p.max_num_batched_tokens:
                raise ValueError(f"{role}: the simulator needs max_num_seqs <= max_num_batched_tokens")
            # NOTE: `auto` gives each worker cores of its own where there are enough: as unpinned workers here
            listed = getattr(p, "cpu_affinity", None)
            affinity = tuple(tuple(c) for c in listed) if isinstance(listed, list) else ()
            pools[str(role)] = PoolShape(p.replicas, blocks, p.block_size, p.max_num_seqs, p.max_num_batched_tokens,
                                    getattr(p, "prefill_order", "fcfs"), affinity)
        return cls(cfg.mode, cfg.router.routing, cfg.router.skip_prefill_max_uncached_tokens, pools,
                   cfg.router.slo_itl_ms, cfg.router.slo_ttft_ms)

    @property
    def num_workers(self) -> int:
        return sum(p.replicas for p in self.pools.values())

    def with_replicas(self, **replicas: int) -> ClusterShape:
        pools = {r: dataclasses.replace(p, replicas=replicas.get(r, p.replicas)) for r, p in self.pools.items()}
        return dataclasses.replace(self, pools=pools)


ARRIVE, RECV_PREFILL, RECV_DECODE, STEP_END, TRANSFER_DONE, ADOPT, NEXT_TURN = range(7)


class Simulator:
    """One run of a workload on a cluster shape with a profile; `run()` returns the requests, timed."""

    def __init__(self, shape: ClusterShape, profile: Profile, overheads: Overheads | None = None) -> None:
        self.shape, self.profile = shape, profile
        self.ov = overheads or Overheads()
        speed = profile.step.speed_tok_s()
        pools: dict[str, Pool] = {}
        for role, ps in shape.pools.items():
            workers = [self._worker(role, i, ps) for i in range(ps.replicas)]
            pools[role] = Pool(workers, speed, prefill_role=role == "prefill")
        self.bs = next(iter(shape.pools.values())).block_size
        decode = pools["colocated"] if shape.mode == "colocated" else pools["decode"]
        # NOTE: the router's own rule: the skip and the SLO placements only with a prefill pool to place around
        settings = RouterSettings(model="", mode=shape.mode, routing=shape.routing,
                                  skip_prefill_max_uncached_tokens=shape.skip_max, slo_itl_ms=shape.slo_itl_ms)
        self.router = SimRouter(settings.policy(self.bs), pools.get("prefill"), decode)
        self.workers = [w for p in pools.values() for w in p.workers]
        affinity = {w.name: ps.cpu_affinity[w.idx % len(ps.cpu_affinity)] if ps.cpu_affinity else ()
                    for role, ps in shape.pools.items() for w in pools[role].workers}
        cores = core_groups(affinity)
        for w in self.workers:
            w.core = cores.get(w.name)
        self.reqs: list[Req] = []
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._turns: dict[int, list[Req]] = {}
        self._sessions: dict[int, Session] = {}
        self._reserved: dict[int, tuple[Job, int]] = {}
        self.now = 0.0
        self.wall_s = 0.0
        self.num_events = 0

    def _worker(self, role: str, i: int, ps: PoolShape) -> Worker:
        # NOTE: as pdcluster/launch_actors.py sets every engine's step_target_ms and ttft_target_ms from the SLOs
        sh = self.shape
        budget = StepBudget(None if sh.slo_itl_ms is None else sh.slo_itl_ms / 1e3,
                            None if sh.slo_ttft_ms is None else sh.slo_ttft_ms / 1e3)
        return Worker(i, f"{role}-{i}", role, self.profile.step, ps.num_blocks, ps.block_size, ps.max_num_seqs,
                      ps.max_num_batched_tokens, BlockCache(ps.num_blocks), self.ov.step_scale, self.ov.step_extra_s,
                      ps.prefill_order, budget)

    # ---- the event loop -------------------------------------------------------------------------------------
    def run(self, workload: Workload) -> list[Req]:
        """Simulate every session of `workload`; the requests in the order they were sent."""
        started = time.perf_counter()
        self._sessions = {s.id: s for s in workload.sessions}
        for s in workload.sessions:
            self._push(s.arrival_s, NEXT_TURN, (s, 0))
        handlers: list[Callable[[Any], None]] = [self._arrive, self._recv_prefill, self._recv_decode,
                                                 self._step_end, self._transfer_done, self._adopt, self._next_turn]
        events = self._events
        n = 0
        while events:
            t, _, kind, obj = heapq.heappop(events)
            self.now = t
            handlers[kind](obj)
            n += 1
        self.num_events = n
        self.wall_s = time.perf_counter() - started
        return self.reqs

    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def _kick(self, w: Worker) -> None:
        if w.busy:
            return
        dt = w.start_step(self.now)
        if dt is None:
            return
        if w.core is None:
            self._push(self.now + dt, STEP_END, (w, 0))
        else:
            for x, version, t in w.core.start(w, dt, self.now):
                self._push(t, STEP_END, (x, version))

    # ---- handlers -------------------------------------------------------------------------------------------
    def _next_turn(self, obj: tuple[Session, int]) -> None:
        s, i = obj
        done = self._turns.setdefault(s.id, [])
        tokens = s.prompt(i, [answer_tokens(r) for r in done])
        req = Req(len(self.reqs), s.id, i, self.now, tokens, block_keys(tokens, self.bs), s.turns[i].max_tokens)
        self.reqs.append(req)
        done.append(req)
        self._arrive(req)

    def _arrive(self, req: Req) -> None:
        route = self.router.route(req)
        req.decode = d = self.router.worker(route.decode)
        if route.prefill is None:
            req.skipped = self.shape.mode == "disaggregated"
            req.placement, req.held_tokens = route.why or "prefill_pool", route.decode_prefill_tokens
            # NOTE: as router/core.py: the prompt tokens `d` computes count in its queue until the first token
            self.router.change(d, inflight=1, pending=req.held_tokens)
            self._push(self.now + self.ov.router_s, RECV_DECODE, req)
        else:
            req.prefill = p = self.router.worker(route.prefill)
            self.router.change(p, inflight=1, pending=req.prompt_len)
            self._push(self.now + self.ov.router_s, RECV_PREFILL, req)

    def _under_lock(self, w: Worker, fn: Callable[[], None]) -> None:
        """Run `fn` once `w`'s engine lock is free: at once when idle, else when its current step ends.

        NOTE: the KV receiver reserves and commits under the decode worker's engine lock, which the loop holds for a
        whole step; a fair lock is modelled (the real one is not fair and can make a caller wait longer).
        """
        if w.busy:
            w.lock_waiters.append(fn)
        else:
            fn()

    def _recv_prefill(self, req: Req) -> None:
        assert req.decode is not None
        self._under_lock(req.decode, lambda: self._handshake(req))

    def _handshake(self, req: Req) -> None:
        """The decode worker reserved the blocks (linking what it caches): the prompt joins the prefill queue."""
        assert req.decode is not None and req.prefill is not None
        self._reserved[req.id] = req.decode.reserve(req)
        req.prefill.add_prompt(req, decodes=False, now=self.now)
        self._kick(req.prefill)

    def _recv_decode(self, req: Req) -> None:
        assert req.decode is not None
        req.decode.add_prompt(req, decodes=True, now=self.now)
        self._kick(req.decode)

    def _step_end(self, obj: tuple[Worker, int]) -> None:
        w, version = obj
        if w.core is not None:
            if not w.core.current(w, version):
                return  # NOTE: re-timed when another step on its core started or ended
            for x, v, t in w.core.end(w, self.now):
                self._push(t, STEP_END, (x, v))
        done = w.end_step(self.now)
        for job in done.prompts:
            req = job.req
            if job.decodes:
                req.t_first = self.now + self.ov.token_s
                if req.held_tokens:
                    self.router.change(w, pending=-req.held_tokens)
                if req.max_tokens == 1:
                    self.router.change(w, inflight=-1)
                    self._finish(req, req.t_first)
                continue
            _, hits = self._reserved[req.id]
            nbytes = (-(-req.prompt_len // self.bs) - hits) * self.bs * self.profile.kv_bytes_per_token
            req.transfer_s = self.profile.transfer.tail_s(nbytes, done.seconds)
            self._push(self.now + req.transfer_s, TRANSFER_DONE, req)
        for req in done.answers:
            self.router.change(w, inflight=-1)
            self._finish(req, self.now + self.ov.token_s)
        if w.lock_waiters:
            waiters, w.lock_waiters = w.lock_waiters, []
            for fn in waiters:
                fn()
        self._kick(w)

    def _transfer_done(self, req: Req) -> None:
        assert req.decode is not None
        self._under_lock(req.decode, lambda: self._committed(req))

    def _committed(self, req: Req) -> None:
        """The decode worker committed the KV: the prefill result (the first token) goes back to the router."""
        assert req.prefill is not None and req.decode is not None
        self.router.change(req.prefill, inflight=-1, pending=-req.prompt_len)
        req.t_first = self.now + self.ov.result_s
        job, _ = self._reserved.pop(req.id)
        if req.max_tokens == 1:
            req.decode.drop_reservation(job)
            self._finish(req, req.t_first)
            return
        self.router.change(req.decode, inflight=1)
        self._push(req.t_first + self.ov.decode_call_s, ADOPT, job)

    def _adopt(self, job: Job) -> None:
        w = job.req.decode
        assert w is not None
        w.adopt(job)
        self._kick(w)

    def _finish(self, req: Req, t_last: float) -> None:
        """The answer's last token reached the client: the session's next turn follows after its think time."""
        req.t_last = t_last
        session = self._sessions[req.session]
        if req.turn + 1 < len(session.turns):
            self._push(t_last + session.think_s[req.turn], NEXT_TURN, (session, req.turn + 1))
