"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`):
1. running sequences first, in admission order: one token each when decoding, the next chunk when their
   prompt is still being prefilled; if the pool runs dry, the most recently admitted sequence is preempted
   (its blocks freed, it goes back to the head of the queue and is recomputed later, usually from cache);
2. then waiting sequences, FCFS, while budget, `max_num_seqs` and free blocks allow, each starting after its
   longest cached prefix.
Requests join and leave the running batch at every step. The scheduler never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


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

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a sequence whose KV is already in place (imported from another engine)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues (its blocks are the caller's business)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        preempted = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            n = min(seq.num_pending_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                picked.append((seq, n))
                budget -= n
                idx += 1
                continue
            break
        # NOTE: after a preemption the pool is tight; admitting new work would only cause more of it.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            n = min(len(seq) - len(hits) * self.bm.block_size, budget)
            if not self.bm.allocate(seq, n, hits):
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = len(hits) * self.bm.block_size
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
        picked.sort(key=lambda p: p[1] != 1)  # stable: single-token (decode) entries first
        return ScheduledBatch([s for s, _ in picked], [n for _, n in picked])

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
