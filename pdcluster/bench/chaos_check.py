"""The invariants of `pdcluster bench chaos`, checked on what the clients saw and what the cluster reports at the end.

- `outcome`: every request either finished or failed with a clear status (a gRPC code, an HTTP status, an SSE
  error event); a stream that just ended without a finish or an error (`CUT`) or a client-side timeout past the
  request's deadline (`HANG`) fails it, except a stream cut while its router was being killed with -9;
- `text`: every finished request's output equals the reference (one in-process engine, greedy, same prompt ids), or
  leaves it only where the engine's top two tokens tie to rounding (chaos_reference.py);
- `tokens`: every finished request has exactly the tokens it asked for (`ignore_eos`): none lost, none repeated;
- `no_leak`: at the end every live worker has all its KV blocks free and nothing running (a leaked admission slot,
  transfer or lease holds blocks), and every router's in-flight count is 0;
- `router_memory`: each router process's resident memory grew by at most the limit from its 5th sample (~10 s).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

WARM_SAMPLES = 5  # router memory samples (2 s apart) before the baseline
Reference = dict[tuple[tuple[int, ...], int], tuple[list[int], str]]  # (prompt, max_tokens) → (ids, text)
UNCLEAR = ("CUT", "HANG")  # failures that carry no status a client could act on
# NOTE: REFUSED / DISCONNECTED are the HTTP client's view of a router process that is gone (gRPC says UNAVAILABLE):
# clear to a client, which retries elsewhere; CUT is a stream the router ended with neither a finish nor an error


@dataclass
class Record:
    """One request as the client saw it."""

    index: int
    start_s: float  # from the start of the run
    proto: str  # "grpc" | "http"
    streamed: bool
    router: str  # "serve" | "extra"
    prompt: list[int]
    max_tokens: int
    status: str = ""  # "OK" or why it failed: a gRPC code, "HTTP_503", "STREAM_ERROR", "REFUSED", "DISCONNECTED",
    # "CUT", "HANG"
    token_ids: list[int] | None = None  # gRPC: the ids received
    text: str = ""  # the text received
    usage_tokens: int = -1  # usage.completion_tokens the server reported (-1: none)
    detail: str = ""
    end_s: float = -1.0  # from the start of the run, when the client had its answer or gave up


@dataclass
class Invariant:
    name: str
    passed: bool
    detail: str


@dataclass
class FinalState:
    """What the cluster reported once the traffic stopped (and it had up to a minute to go idle)."""

    workers: list[dict[str, Any]] = field(default_factory=list)  # name, alive, running, free_blocks, num_blocks
    router_inflight: dict[str, float | None] = field(default_factory=dict)  # router → in-flight (None: unreachable)


def check(records: list[Record], reference: Reference,
          final: FinalState, rss_mb: dict[str, list[float]], rss_limit_mb: float,
          router_kills_s: tuple[float, ...] = (), ties: dict[int, str] | None = None) -> list[Invariant]:
    """The five invariants over the run; `reference[(prompt, max_tokens)]` = (ids, text) of one engine;
    `router_kills_s`: when the extra router was killed with -9; `ties`: the requests (by index) that differ from
    the reference only by near ties of the engine's greedy choice (chaos_reference.near_ties)."""
    ties = ties or {}
    ok = [r for r in records if r.status == "OK"]
    # NOTE: a process killed with -9 sends no error event: a stream cut while its router was killed is expected
    killed = [r for r in records if r.status == "CUT" and r.router == "extra"
              and any(r.start_s <= k <= r.end_s for k in router_kills_s)]
    unclear = Counter(r.status for r in records if r.status in UNCLEAR and r not in killed)
    differ = [r for r in ok if wrong_text(r, reference)]
    wrong = [r for r in differ if r.index not in ties]
    tied = [r for r in differ if r.index in ties]
    lost = sum(max(0, r.max_tokens - _count(r)) for r in ok)
    repeated = sum(max(0, _count(r) - r.max_tokens) for r in ok)
    short = [r for r in ok if _count(r) != r.max_tokens]
    leaks = [f"{w['name']}: {w['num_blocks'] - w['free_blocks']} blocks held, {w['running']} running"
             for w in final.workers if w["alive"] and (w["free_blocks"] != w["num_blocks"] or w["running"])]
    # NOTE: every pool restarts its actors here (max_restarts), so a worker without a heartbeat at the end is one
    # whose blocks nobody can check (Redis gone, or the worker itself): the invariant is not shown to hold
    leaks += [f"{w['name']}: no heartbeat, its blocks cannot be checked" for w in final.workers if not w["alive"]]
    if not final.workers:
        leaks.append("serve did not report its workers")
    leaks += [f"router {name}: in-flight {v if v is not None else 'unknown (unreachable)'}"
              for name, v in final.router_inflight.items() if v != 0]
    # NOTE: from the 5th sample (~10 s in): a fresh process still imports and warms up in its first seconds
    growth = {name: round(max(s[min(WARM_SAMPLES, len(s) - 1):]) - s[min(WARM_SAMPLES, len(s) - 1)], 1)
              for name, s in rss_mb.items() if s}
    return [
        Invariant("outcome", not unclear and bool(records),
                  f"{len(ok)} finished, {len(records) - len(ok) - sum(unclear.values())} failed with a status"
                  + (f" ({len(killed)} cut by their router's kill -9)" if killed else "")
                  + (f", {sum(unclear.values())} without one {dict(unclear)}" if unclear else "")),
        Invariant("text", not wrong, f"{len(ok) - len(wrong)}/{len(ok)} finished requests gave the engine's text"
                  + (f" ({len(tied)} after a near tie of its greedy choice; first: request {tied[0].index} at "
                     f"{ties[tied[0].index]}, where the reference batch took the other)" if tied else "")
                  + (f"; first wrong: {_wrong_detail(wrong[0], reference)}" if wrong else "")),
        Invariant("tokens", not short, f"{lost} tokens lost, {repeated} repeated in {len(short)} requests"),
        Invariant("no_leak", not leaks, "; ".join(leaks) or "every worker's blocks free, nothing running, "
                                                            "routers' in-flight 0"),
        Invariant("router_memory", bool(growth) and all(g <= rss_limit_mb for g in growth.values()),
                  ", ".join(f"{n} +{g} MB" for n, g in growth.items()) + f" (limit +{rss_limit_mb:.0f} MB)"),
    ]


def _count(r: Record) -> int:
    """Tokens received: the ids a gRPC client got, else (HTTP returns text) the usage the server reported."""
    return len(r.token_ids) if r.token_ids is not None else r.usage_tokens


def wrong_text(r: Record, reference: Reference) -> bool:
    ref = reference.get((tuple(r.prompt), r.max_tokens))
    if ref is None:
        return True
    return r.token_ids != ref[0] if r.token_ids is not None else r.text != ref[1]


def _wrong_detail(r: Record, reference: Reference) -> str:
    """Which request gave a wrong text, when and where, and what it got against the engine's (to look into it)."""
    ref = reference.get((tuple(r.prompt), r.max_tokens))
    want = "no reference" if ref is None else repr(ref[1][:120])
    got = repr(r.text[:120]) if r.token_ids is None else f"ids {r.token_ids[:40]} vs {ref[0][:40] if ref else None}"
    return (f"request {r.index} ({r.proto}, {'streamed' if r.streamed else 'unary'}, router {r.router}, "
            f"{r.start_s:.1f}–{r.end_s:.1f} s): got {got}, the engine gave {want}")


def windows(records: list[Record], width_s: float) -> list[dict[str, Any]]:
    """Outcome counts per window of `width_s` by request start: {"from_s", "OK", <failure status>: n, ...}."""
    if not records:
        return []
    out: dict[int, Counter[str]] = {}
    for r in records:
        out.setdefault(int(r.start_s // width_s), Counter())[r.status] += 1
    return [{"from_s": round(i * width_s, 1), **dict(sorted(out.get(i, Counter()).items()))}
            for i in range(max(out) + 1)]
