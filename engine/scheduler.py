"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`):
1. running sequences first: every decoding one (one token each, in admission order), then those whose prompt
   is still being prefilled (the next chunk each); if the pool runs dry, the most recently admitted sequence
   not yet in this step is preempted (its blocks freed, it goes back to the head of the queue and is
   recomputed later, usually from cache);
2. then waiting sequences while budget, `max_num_seqs` and free blocks allow, each starting after its longest
   cached prefix.
`prefill_order` orders the prompt work of steps 1 and 2: "fcfs" (arrival order, the default) or
"shortest_first" (fewest prompt tokens left first; preempted sequences still go first), which lets a short
prompt overtake a long one mid-prefill, as a prefill worker behind a TTFT objective wants. A long prompt still
gets whatever budget the short ones leave in each step, and once its age nears the TTFT target (`StepBudget.overdue`)
it goes first, so a stream of short prompts cannot push a document past its target.
The ITL budget (`StepBudget.prompt_tokens`, engine/step_budget.py): in a step that decodes for someone, prompt work
gets at most the tokens left of the step-time target after the decode tokens (from the measured step cost), apart
from `max_num_batched_tokens`; a prompt may so start in a decode batch and finish over several steps.
With speculative decoding a decoding sequence carries draft tokens (`spec_token_ids`); it is given 1 + drafts
tokens (a verification entry) while budget and blocks allow, and its drafts are the first thing dropped when they do
not. Requests join and leave the running batch at every step. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.step_budget import StepBudget

PREFILL_ORDERS = ("fcfs", "shortest_first")


@dataclass
class ScheduledBatch:
    """What one step computes: `num_new_tokens[i]` tokens of `seqs[i]`, single-token entries first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Decides which sequences run in the next step and how many tokens each computes."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_order: str = "fcfs", budget: StepBudget | None = None) -> None:
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order: {prefill_order!r}; use one of {PREFILL_ORDERS}")
        self.shortest_first = prefill_order == "shortest_first"
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # NOTE: paused by their consumer (a client that stopped reading): never scheduled; a RUNNING one keeps its
        # blocks until the pool runs dry, then it is the first preempted (recomputed on resume, mostly from cache)
        self.paused: list[Sequence] = []
        self.num_preemptions = 0
        self.budget = budget or StepBudget()  # the ITL budget and the TTFT bound (the worker sets its step cost)
        self.clock = time.monotonic  # a prompt's age is measured with it
        self.prompt_cap: int | None = None  # the last step's ITL budget for prompt tokens (None: none applied)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a sequence whose KV is already in place (imported from another engine)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed, of every running and waiting sequence."""
        return sum(s.num_pending_tokens for s in (*self.running, *self.waiting) if s.num_pending_tokens > 1)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues (its blocks are the caller's business)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.paused:
            self.paused.remove(seq)

    def pause(self, seq: Sequence) -> bool:
        """Stop scheduling `seq` until `resume` (it keeps its blocks); False when it is in neither queue."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        seq.spec_token_ids.clear()
        self.paused.append(seq)
        return True

    def resume(self, seq: Sequence) -> None:
        """Schedule a paused sequence again: decoding on where it held its blocks, else queued first."""
        if seq not in self.paused:
            return
        self.paused.remove(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.append(seq)
        else:
            self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        self._budget = self.max_num_batched_tokens
        self._picked: list[tuple[Sequence, int]] = []
        self._in_step: set[int] = set()
        self._preempted = False
        decoding = [s for s in self.running if s.num_pending_tokens == 1]
        prompts = [s for s in self.running if s.num_pending_tokens > 1]
        for seq in decoding:
            self._schedule_running(seq)
        if self.shortest_first:
            queue = sorted(prompts + list(self.waiting), key=self._shortest_first_key(self.clock()))
        else:
            queue = prompts + list(self.waiting)
        self._cap_prompt_work(bool(queue))
        admitting = True
        for seq in queue:
            if self._budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                self._schedule_running(seq)
            elif admitting and id(seq) not in self._in_step:
                # NOTE: after a preemption the pool is tight; admitting new work would only cause more of it.
                admitting = (not self._preempted and len(self.running) + len(self.paused) < self.max_num_seqs
                             and self._admit(seq))
        picked = self._picked
        picked.sort(key=lambda p: p[1] != 1)  # stable: single-token (decode) entries first
        return ScheduledBatch([s for s, _ in picked], [n for _, n in picked])

    def _shortest_first_key(self, now: float) -> Callable[[Sequence], tuple[int, int, float]]:
        """Preempted ones keep their turn; then prompts overdue for the TTFT target, oldest first; then the rest on
        tokens left (running chunks and waiting prompts compete)."""
        limit = self.max_num_batched_tokens

        def key(s: Sequence) -> tuple[int, int, float]:
            if s.num_preemptions and s.status is not SequenceStatus.RUNNING:
                return 0, 0, s.num_pending_tokens
            if self.budget.overdue(now - s.arrival_time, s.num_pending_tokens, limit):
                return 1, 0, s.arrival_time
            return 1, 1, s.num_pending_tokens
        return key

    def _cap_prompt_work(self, has_prompt_work: bool) -> None:
        """Apply the ITL budget to what is left of this step once its decode tokens are in."""
        decode_tokens = self.max_num_batched_tokens - self._budget
        self.prompt_cap = self.budget.prompt_tokens(decode_tokens)
        # NOTE: a block a step once prompt work starved STARVED_STEPS_MAX steps, until the budget comes back
        cap = self.budget.step_cap(decode_tokens, has_prompt_work, self.bm.block_size)
        if cap is not None:
            self._budget = min(self._budget, cap)

    def _schedule_running(self, seq: Sequence) -> None:
        """Its next token or prompt chunk; preempt the latest-admitted others (or itself) when blocks run out."""
        if self._budget <= 0 or seq.status is not SequenceStatus.RUNNING:
            return  # out of budget, or preempted earlier in this step
        n = min(seq.num_pending_tokens + len(seq.spec_token_ids), self._budget)
        if seq.spec_token_ids:
            del seq.spec_token_ids[max(0, n - seq.num_pending_tokens):]
        while not self.bm.allocate(seq, n):
            if seq.spec_token_ids:
                seq.spec_token_ids.clear()
                n = min(seq.num_pending_tokens, self._budget)
                continue
            if self._preempt_paused():
                continue
            victim = next(s for s in reversed(self.running) if id(s) not in self._in_step)
            self.running.remove(victim)
            self._preempt(victim)
            self._preempted = True
            if victim is seq:
                return
        self._picked.append((seq, n))
        self._in_step.add(id(seq))
        self._budget -= n

    def _admit(self, seq: Sequence) -> bool:
        """Start a waiting sequence after its longest cached prefix; False when its blocks do not fit."""
        hits = self.bm.match_prefix(seq)
        n = min(len(seq) - len(hits) * self.bm.block_size, self._budget)
        while not self.bm.allocate(seq, n, hits):
            if not self._preempt_paused():
                return False
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = len(hits) * self.bm.block_size
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._picked.append((seq, n))
        self._in_step.add(id(seq))
        self._budget -= n
        return True

    def _preempt_paused(self) -> bool:
        """Free the blocks of a paused sequence that holds some (it computes nothing meanwhile); False if none."""
        held = next((s for s in self.paused if s.status is SequenceStatus.RUNNING), None)
        if held is None:
            return False
        self.bm.free(held)
        held.status = SequenceStatus.WAITING
        held.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
