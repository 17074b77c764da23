"""A simulated worker: the engine scheduler's decisions and the step model's times, without a model.

Each step mirrors `engine.scheduler.Scheduler.schedule` under the token budget `max_num_batched_tokens`:
1. every decoding sequence computes one token;
2. prompts already admitted compute their next chunk, in admission order;
3. waiting prompts are admitted while budget, `max_num_seqs` and free blocks allow, after their longest cached
   prefix; prompt work goes in arrival order, or fewest tokens left first (`prefill_order: shortest_first`; a prompt
   overdue for the TTFT target goes first, `StepBudget.overdue`).
Prompt work beside decoding sequences gets at most the ITL budget (`StepBudget.step_cap`, from the step cost this
worker measures on its own steps, `sim_load.SimLoad`), as the engine's scheduler gives it.
Decoding sequences are kept in aggregate (count, sum and max of contexts, a heap of finishing steps), so a step costs
O(1) plus the sequences that join or leave it: what lets a thousand workers simulate in seconds. Each request's
token times are the end times of the steps it was in. Approximations: a decoding sequence gets the blocks for its
whole answer when it starts decoding (answers have a known length), and nothing is preempted.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.step_budget import StepBudget
from pdcluster.plan.profile import StepModel, prefill_pairs
from pdcluster.plan.sim_cache import BlockCache, block_keys
from pdcluster.plan.sim_load import SimLoad

if TYPE_CHECKING:
    from pdcluster.plan.sim_cores import SharedCore


@dataclass(eq=False)
class Req:
    """One request (a turn of a session) and what happened to it."""

    id: int
    session: int
    turn: int
    sent: float
    tokens: list[int]  # the prompt
    keys: list[int]  # chained keys of the prompt's full blocks
    max_tokens: int
    prefill: Worker | None = None
    decode: Worker | None = None
    cached_tokens: int = 0
    skipped: bool = False
    placement: str = "prefill_pool"  # the route's `why` (router/policy.py), "prefill_pool" for the usual path
    held_tokens: int = 0  # prompt tokens the router counts on `decode` until the first token (prefill None)
    t_first: float = 0.0
    transfer_s: float = 0.0
    dec_step: int = -1  # index of the decode worker's first step that decodes it
    t_last: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class Job:
    """A request's prompt on one worker: its blocks and how much of it is computed."""

    req: Req
    decodes: bool  # this worker decodes the request after its prompt (colocated, prefill skipped)
    table: list[int] = field(default_factory=list)
    computed: int = 0
    registered: int = 0
    arrived: float = 0.0  # when the prompt reached this worker (the age `shortest_first` bounds)


@dataclass
class StepDone:
    """What a step finished: prompts (their first token sampled) and answers (their last token)."""

    seconds: float
    prompts: list[Job]
    answers: list[Req]


class Worker:
    """One simulated worker of a pool: queues, blocks, a prefix cache and a step clock."""

    def __init__(self, idx: int, name: str, role: str, step: StepModel, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, cache: BlockCache, step_scale: float = 1.0,
                 step_extra_s: float = 0.0, prefill_order: str = "fcfs", budget: StepBudget | None = None) -> None:
        self.idx, self.name, self.role = idx, name, role
        self.model = step
        self.cache = cache
        self.bs = block_size
        self.max_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.scale, self.extra = step_scale, step_extra_s
        self.shortest_first = prefill_order == "shortest_first"
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.joining: list[Req] = []
        self.steps = 0  # steps started
        self.core: SharedCore | None = None  # set when other workers are pinned to the same cores
        self.lock_waiters: list[Callable[[], None]] = []  # calls that need the engine lock between two steps
        self._started = 0.0
        self.step_ends: list[float] = []
        self.busy = False
        self.overflow_blocks = 0  # blocks a decoding sequence lacked (the engine would have preempted)
        # the decoding sequences in aggregate: ctx at step s = base + s
        self.n_dec = 0
        self.dec_base_sum = 0
        self._dec_max: list[tuple[int, int]] = []  # (-base, req id), lazily cleaned
        self._dec_alive: dict[int, int] = {}  # req id -> base
        self._finish: list[tuple[int, int, Req]] = []  # (last step index, req id, req)
        self._chunks: list[tuple[Job, int]] = []
        self._jobs: dict[int, Job] = {}  # decoding here, by request id
        self._step_s = 0.0
        self.padded = step.decode_attention == "padded"
        self.step_budget = budget or StepBudget()
        self.measured = SimLoad(num_blocks, max_num_batched_tokens, self.shortest_first, self.step_budget)
        self.n_reserved = 0  # KV reservations not yet committed
        self.pending_tokens = 0  # prompt tokens queued or prefilling, not yet computed (the heartbeat's count)
        self._tokens = 0  # tokens of the step in progress

    @property
    def num_running(self) -> int:
        return self.n_dec + len(self.joining) + len(self.prefilling)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.joining or self.n_dec)

    # ---- requests in ------------------------------------------------------------------------------------------
    def add_prompt(self, req: Req, decodes: bool, now: float = 0.0) -> None:
        """Queue a prompt to compute here (a prefill, or a whole request: colocated or prefill skipped)."""
        self.waiting.append(Job(req, decodes, arrived=now))
        self.pending_tokens += req.prompt_len
        self._report()

    def _report(self) -> None:
        self.measured.queues(self.num_running, len(self.waiting), self.n_reserved, self.pending_tokens)

    def reserve(self, req: Req) -> tuple[Job, int]:
        """Reserve blocks for an incoming KV transfer; returns the job and how many leading blocks were cached."""
        job = Job(req, True)
        hits = self.cache.depth(req.keys)
        job.table = self.cache.acquire(req.keys[:hits])
        need = -(-req.prompt_len // self.bs) - hits
        fresh = self.cache.allocate(need)
        if fresh is None:
            self.overflow_blocks += need
            fresh = []
        job.table += fresh
        job.computed, job.registered = req.prompt_len, hits
        self.n_reserved += 1
        self._report()
        return job, hits

    def adopt(self, job: Job) -> None:
        """The transferred KV is committed: the request joins the batch at the next step."""
        self._register(job, job.req.prompt_len)
        self._grow_for_answer(job)
        self.joining.append(job.req)
        self._jobs[job.req.id] = job
        self.n_reserved -= 1
        self._report()

    def release(self, job: Job) -> None:
        self.cache.release(job.table)
        job.table = []

    def drop_reservation(self, job: Job) -> None:
        """A reserved transfer that will not decode here (the request ended at its first token)."""
        self.release(job)
        self.n_reserved -= 1
        self._report()

    # ---- steps ------------------------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule the next step at `now`; its duration alone in seconds, or None when there is nothing to do."""
        s = self.steps
        if self.joining:
            for req in self.joining:
                base = req.prompt_len + 1 - s  # NOTE: the first decode step computes the first token's KV
                self.dec_base_sum += base
                self._dec_alive[req.id] = base
                if self.padded:
                    heapq.heappush(self._dec_max, (-base, req.id))
                heapq.heappush(self._finish, (s + req.max_tokens - 2, req.id, req))
                req.dec_step = s
            self.n_dec += len(self.joining)
            self.joining.clear()
        tokens = samples = self.n_dec
        pairs = 0.0
        chunks: list[tuple[Job, int]] = []
        prompt_work = bool(self.prefilling or self.waiting)
        # NOTE: the ITL budget beside decode; once every step, as the engine (a step without prompt work ends a
        # starving streak)
        cap = self.step_budget.step_cap(self.n_dec, prompt_work, self.bs)
        if prompt_work:  # NOTE: the common decode-only step skips this
            room = self.budget - self.n_dec
            chunks = self._prompt_chunks(room if cap is None else min(room, cap), now)
            for job, n in chunks:
                tokens += n
                samples += job.computed + n == job.req.prompt_len
                pairs += prefill_pairs(n, job.computed)
        if tokens == 0:
            return None
        if self.padded:
            while self._dec_max and self._dec_alive.get(self._dec_max[0][1]) is None:
                heapq.heappop(self._dec_max)
            keys_dec = self.n_dec * (-self._dec_max[0][0] + s) if self.n_dec else 0
        else:
            keys_dec = self.dec_base_sum + self.n_dec * s
        self._chunks = chunks
        self._tokens = tokens
        self._step_s = self.model.time(tokens, samples, keys_dec, pairs) * self.scale + self.extra
        self.steps += 1
        self.busy = True
        self._started = now
        if chunks:
            self._report()  # NOTE: admitted prompts moved from waiting to running
        return self._step_s

    def _prompt_chunks(self, budget: int, now: float) -> list[tuple[Job, int]]:
        """Prompt work of a step: admitted prompts' next chunks and newly admitted ones, in `prefill_order`."""
        chunks: list[tuple[Job, int]] = []
        if self.shortest_first:
            sb, limit = self.step_budget, self.budget

            def key(j: Job) -> tuple[int, float]:  # NOTE: engine/scheduler.py `_shortest_first_key`, no preemption
                left = j.req.prompt_len - j.computed
                return (0, j.arrived) if sb.overdue(now - j.arrived, left, limit) else (1, left)
            queue = sorted(self.prefilling + list(self.waiting), key=key)
        else:
            queue = self.prefilling + list(self.waiting)
        admitting = True
        for job in queue:
            if budget <= 0:
                break
            if job.table:  # admitted: its next chunk
                n = min(job.req.prompt_len - job.computed, budget)
                if self._grow(job, job.computed + n):
                    chunks.append((job, n))
                    budget -= n
                continue
            if not admitting or self.num_running >= self.max_seqs:
                admitting = False
                continue
            keys = job.req.keys
            # NOTE: the last prompt token is always computed: its logits sample the first output token
            hits = self.cache.depth(keys, (job.req.prompt_len - 1) // self.bs)
            n = min(job.req.prompt_len - hits * self.bs, budget)
            need = -(-(hits * self.bs + n) // self.bs) - hits
            if need > self.cache.free_after(keys[:hits]):
                admitting = False  # NOTE: as the engine: once one prompt does not fit, none after it is admitted
                continue
            job.table = self.cache.acquire(keys[:hits]) + (self.cache.allocate(need) or [])
            job.computed, job.registered = hits * self.bs, hits
            job.req.cached_tokens = hits * self.bs
            self.pending_tokens -= hits * self.bs
            if self.shortest_first:
                self.waiting.remove(job)
            else:
                self.waiting.popleft()  # NOTE: in arrival order only the head is ever admitted
            self.prefilling.append(job)
            chunks.append((job, n))
            budget -= n
        return chunks

    def end_step(self, now: float) -> StepDone:
        """Apply the step that just ended at `now`: prompts done, tokens out, answers finished."""
        s = self.steps - 1
        self.step_ends.append(now)
        self.busy = False
        self.measured.stepped(self._tokens, now - self._started)
        prompts: list[Job] = []
        for job, n in self._chunks if self._chunks else ():
            job.computed += n
            self.pending_tokens -= n
            self._register(job, job.computed)
            if job.computed == job.req.prompt_len:
                self.prefilling.remove(job)
                prompts.append(job)
                if not job.decodes or job.req.max_tokens == 1:
                    self.release(job)
                else:
                    self._grow_for_answer(job)
                    self.joining.append(job.req)
                    self._jobs[job.req.id] = job
        self._chunks = []
        answers: list[Req] = []
        fin = self._finish
        while fin and fin[0][0] == s:
            _, rid, req = heapq.heappop(fin)
            base = self._dec_alive.pop(rid)
            self.dec_base_sum -= base
            self.n_dec -= 1
            job = self._jobs.pop(rid)
            self._register_answer(job)
            self.release(job)
            answers.append(req)
        self._report()
        return StepDone(now - self._started, prompts, answers)  # NOTE: longer than alone on a shared core

    # ---- blocks -----------------------------------------------------------------------------------------------
    def _grow(self, job: Job, tokens: int) -> bool:
        need = -(-tokens // self.bs) - len(job.table)
        if need <= 0:
            return True
        fresh = self.cache.allocate(need)
        if fresh is None:
            return False
        job.table += fresh
        return True

    def _grow_for_answer(self, job: Job) -> None:
        total = job.req.prompt_len + job.req.max_tokens - 1  # NOTE: the last token's KV is never computed
        if not self._grow(job, total):
            self.overflow_blocks += -(-total // self.bs) - len(job.table)

    def _register(self, job: Job, tokens: int) -> None:
        full = min(tokens // self.bs, len(job.req.keys), len(job.table))
        for i in range(job.registered, full):
            self.cache.register(job.table[i], job.req.keys[i])
        job.registered = max(job.registered, full)

    def _register_answer(self, job: Job) -> None:
        """At the end: the answer's full blocks enter the cache too (what the session's next turn resends)."""
        req = job.req
        total = req.prompt_len + req.max_tokens - 1
        n_full = min(total // self.bs, len(job.table))
        if n_full <= len(req.keys):
            return
        keys = block_keys(req.tokens + answer_tokens(req), self.bs, n_full)
        for i in range(job.registered, n_full):
            self.cache.register(job.table[i], keys[i])
        job.registered = n_full


def answer_tokens(req: Req) -> list[int]:
    """Synthetic token ids of a request's answer: negative, unique per request and position."""
    base = -(req.id + 1) * 100_000
    return list(range(base, base - req.max_tokens, -1))
