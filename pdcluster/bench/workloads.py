"""Synthetic serving workloads: who sends what, and when (`pdcluster bench serve` and the planner share them).

A workload is a list of sessions. A session arrives at a time drawn from a Poisson process and sends one or more
turns; turn i+1 goes out `think_s[i]` seconds after turn i's answer has fully arrived, and its prompt is the whole
conversation so far (the previous prompt, the previous answer's tokens, then the new user tokens), as a chat
client resends it. Single-turn workloads are sessions of one turn. Lengths are drawn from log-normal distributions
fitted to published statistics (no dataset is downloaded); prompts are random token ids of the model's vocabulary
(as vLLM's "random" dataset), and answers have an exact length (`ignore_eos`), so every run of a seed asks the
cluster for the same amount of work.

Workloads (`WORKLOADS`):
- `sharegpt`: chat, input mean 161 / output mean 338 tokens (ShareGPT as reported in the vLLM paper), heavy tailed;
- `summarization`: long prompts, short answers (input ~1,200, output ~80: a news article and its summary);
- `shared_prompt`: many users behind one long system prompt (1,024 tokens), 4 turns each, short messages;
- `mixed`: 80% short chat turns and 20% long documents (1,000-1,500 tokens): prefills that stall colocated decode;
- `system_prompt`: one 900-token system prompt in front of every request, then a short question (~32 tokens) and
  a short answer (~64): single turns, so each request's new work is the question alone when the prefix is cached;
- `chat_to_documents`: a shift halfway: the first half of the requests are `sharegpt` chat, the second half
  `summarization` documents (long prompts, short answers); what an autoscaler must follow (pdcluster/autoscale.py).
`input_scale` / `output_scale` stretch the lengths (a 2-core laptop needs shorter answers than a GPU); `think_scale`
stretches the users' pauses between turns (0: the next turn goes out as soon as the answer arrived).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    """One request of a session: the tokens the user adds and how many tokens the answer has."""

    user_tokens: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """A user: arrives at `arrival_s`, sends `turns` one after another, pausing `think_s[i]` after answer i."""

    id: int
    arrival_s: float
    turns: tuple[Turn, ...]
    think_s: tuple[float, ...] = ()
    shared_prefix_tokens: int = 0  # leading tokens of turn 0 that every session of the workload shares

    def prompt(self, i: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """The prompt of turn i, given the answers (token ids) of turns 0..i-1."""
        out: list[int] = []
        for j in range(i):
            out += self.turns[j].user_tokens
            out += answers[j]
        out += self.turns[i].user_tokens
        return out

    def prompt_len(self, i: int) -> int:
        """Prompt length of turn i (answers have exactly `max_tokens` tokens)."""
        return sum(len(t.user_tokens) + t.max_tokens for t in self.turns[:i]) + len(self.turns[i].user_tokens)


@dataclass(frozen=True)
class Workload:
    """The sessions of one benchmark run, sorted by arrival."""

    name: str
    rate: float  # requests (turns) per second, all sessions together
    sessions: tuple[Session, ...]
    params: dict[str, float] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> str:
        lens = [s.prompt_len(i) for s in self.sessions for i in range(len(s.turns))]
        outs = [t.max_tokens for s in self.sessions for t in s.turns]
        return (f"{self.name}: {self.num_requests} requests in {len(self.sessions)} sessions at {self.rate:g} req/s; "
                f"prompt mean {sum(lens) / len(lens):.0f} (max {max(lens)}), output mean {sum(outs) / len(outs):.0f}")


def lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal length with the given mean, clamped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


class _Draw:
    """Random lengths and token ids for one workload build."""

    def __init__(self, seed: int, salt: int, vocab: tuple[int, int], input_scale: float, output_scale: float,
                 think_scale: float) -> None:
        self.rng = random.Random(seed)
        # NOTE: token ids come from their own stream, so a new salt changes the tokens (a cold prefix cache for
        # the next run on a warm cluster) while every length, turn and pause stays the same.
        self.token_rng = random.Random(f"{seed}:{salt}")
        self.vocab = vocab
        self.input_scale = input_scale
        self.output_scale = output_scale
        self.think_scale = think_scale

    def tokens(self, n: int) -> tuple[int, ...]:
        lo, hi = self.vocab
        return tuple(self.token_rng.randrange(lo, hi) for _ in range(n))

    def input_len(self, mean: float, sigma: float, lo: int, hi: int) -> int:
        s = self.input_scale
        return lognormal(self.rng, mean * s, sigma, max(1, round(lo * s)), max(1, round(hi * s)))

    def output_len(self, mean: float, sigma: float, lo: int, hi: int) -> int:
        s = self.output_scale
        return lognormal(self.rng, mean * s, sigma, max(1, round(lo * s)), max(1, round(hi * s)))

    def think_s(self, mean: float) -> float:
        """A user's pause before the next turn: exponential with the given mean, stretched by `think_scale`."""
        return self.rng.expovariate(1 / mean) * self.think_scale


def _sharegpt(d: _Draw, sid: int, t: float, shared: tuple[int, ...]) -> Session:
    n_in = d.input_len(161, 1.0, 4, 1024)
    return Session(sid, t, (Turn(d.tokens(n_in), d.output_len(338, 0.8, 4, 1024)),))


def _summarization(d: _Draw, sid: int, t: float, shared: tuple[int, ...]) -> Session:
    n_in = d.input_len(1200, 0.35, 256, 2000)
    return Session(sid, t, (Turn(d.tokens(n_in), d.output_len(80, 0.5, 8, 256)),))


def _shared_prompt(d: _Draw, sid: int, t: float, shared: tuple[int, ...]) -> Session:
    turns = []
    for i in range(SHARED_PROMPT_TURNS):
        user = d.tokens(d.input_len(48, 0.6, 8, 160))
        turns.append(Turn((shared + user) if i == 0 else user, d.output_len(48, 0.5, 8, 128)))
    think = tuple(d.think_s(SHARED_PROMPT_THINK_S) for _ in range(SHARED_PROMPT_TURNS - 1))
    return Session(sid, t, tuple(turns), think, shared_prefix_tokens=len(shared))


def _mixed(d: _Draw, sid: int, t: float, shared: tuple[int, ...]) -> Session:
    if d.rng.random() < MIXED_LONG_FRACTION:
        n_in = round(d.rng.uniform(1000, 1500) * d.input_scale)
        return Session(sid, t, (Turn(d.tokens(n_in), max(1, round(32 * d.output_scale))),))
    return Session(sid, t, (Turn(d.tokens(d.input_len(96, 0.6, 16, 256)), d.output_len(64, 0.4, 16, 160)),))


def _system_prompt(d: _Draw, sid: int, t: float, shared: tuple[int, ...]) -> Session:
    question = d.tokens(d.input_len(32, 0.5, 8, 96))
    return Session(sid, t, (Turn(shared + question, d.output_len(64, 0.4, 16, 160)),),
                   shared_prefix_tokens=len(shared))


SHARED_PROMPT_LEN = 1024
SHARED_PROMPT_TURNS = 4
SHARED_PROMPT_THINK_S = 2.0
SYSTEM_PROMPT_LEN = 900
MIXED_LONG_FRACTION = 0.2

_Builder = Callable[[_Draw, int, float, tuple[int, ...]], Session]
WORKLOADS: dict[str, _Builder] = {"sharegpt": _sharegpt, "summarization": _summarization,
                                  "shared_prompt": _shared_prompt, "mixed": _mixed, "system_prompt": _system_prompt,
                                  "chat_to_documents": _sharegpt}  # NOTE: `build` switches to documents halfway
SHIFTS: dict[str, tuple[_Builder, _Builder]] = {"chat_to_documents": (_sharegpt, _summarization)}
_TURNS = {"shared_prompt": SHARED_PROMPT_TURNS}
_SHARED_LEN = {"shared_prompt": SHARED_PROMPT_LEN, "system_prompt": SYSTEM_PROMPT_LEN}


def build(name: str, rate: float, num_requests: int, seed: int = 0, vocab: tuple[int, int] = (256, 49152),
          input_scale: float = 1.0, output_scale: float = 1.0, salt: int = 0, think_scale: float = 1.0) -> Workload:
    """`num_requests` requests (whole sessions, rounded up) of workload `name`, Poisson arrivals at `rate` req/s.

    The same (name, num_requests, seed, scales) give the same lengths and pauses at every rate and salt: only
    arrival times scale, so runs at several rates compare like with like; `salt` draws other token ids.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; choose one of {sorted(WORKLOADS)}")
    if rate <= 0 or num_requests <= 0:
        raise ValueError("rate and num_requests must be > 0")
    if think_scale < 0:
        raise ValueError("think_scale must be >= 0")
    turns = _TURNS.get(name, 1)
    d = _Draw(seed, salt, vocab, input_scale, output_scale, think_scale)
    shared = d.tokens(round(_SHARED_LEN[name] * input_scale)) if name in _SHARED_LEN else ()
    arrivals = random.Random(seed + 1)
    sessions, t = [], 0.0
    n = math.ceil(num_requests / turns)
    for sid in range(n):
        # NOTE: sessions arrive at rate / turns, so turns reach the cluster at about `rate` per second.
        t += arrivals.expovariate(rate / turns)
        builder = SHIFTS[name][sid >= n // 2] if name in SHIFTS else WORKLOADS[name]
        sessions.append(builder(d, sid, t, shared))
    params = {"input_scale": input_scale, "output_scale": output_scale, "seed": seed, "salt": salt,
              "think_scale": think_scale}
    return Workload(name, rate, tuple(sessions), params)
