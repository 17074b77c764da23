"""What the simulator moves around: a request (a turn of a session), its prompt on one worker, a step's results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.plan.sim_worker import Worker


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


def answer_tokens(req: Req) -> list[int]:
    """Synthetic token ids of a request's answer: negative, unique per request and position."""
    base = -(req.id + 1) * 100_000
    return list(range(base, base - req.max_tokens, -1))
