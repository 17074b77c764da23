"""A request's run across workers without Ray: fake actor handles whose calls fail on cue.

What a user would notice: every token once and in order after failovers, the streamed text adding up, every worker
touched told to abort when a run does not finish, and the router's per-worker load (in flight, pending prompt
tokens) back at zero on every worker afterwards, so later routing is not skewed by requests long gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cluster.messages import DecodeRequest, Delta, PrefillRequest, PrefillResult, Role, WorkerInfo
from engine import SamplingParams
from kv_transfer.state import TransferError
from router.core import Router
from router.errors import WorkerFailed
from router.flow import MAX_FAILOVERS, RequestRun
from router.metrics import RouterMetrics
from router.policy import Route, WorkerView
from router.pools import WorkerHandle, WorkerPools
from router.results import Chunk
from router.settings import RouterSettings
from router.validate import Checked

PROMPT = [1, 2, 3, 4, 5]
FIRST = 100  # output token i is FIRST + i, its text "<FIRST + i>"


class FakeTokenizer:
    """Token t is the text "<t>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in ids)


class Remote:
    """`actor.method` of a Ray handle: `.remote(...)` and `.options(...)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)

    def options(self, **_: Any) -> Remote:
        return self


class FakeActor:
    """A worker whose i-th call fails after `fail_after[i]` deltas (prefill: 0 fails it; None: never fails)."""

    def __init__(self, fail_after: list[int | None] | None = None, error: type[Exception] = WorkerFailed) -> None:
        self.fail_after, self.error = list(fail_after or []), error
        self.aborted: list[str] = []
        self.requests: list[DecodeRequest] = []
        self.calls = 0
        self.abort = Remote(self.aborted.append)
        self.generate = Remote(self._generate)
        self.prefill = Remote(self._prefill)
        self.ping = Remote(self._ping)

    async def _ping(self) -> int:
        return 1

    def _failure(self) -> int | None:
        self.calls += 1
        return self.fail_after.pop(0) if self.fail_after else None

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        if self._failure() == 0:
            raise self.error("the prefill worker died")
        return PrefillResult(req.request_id, [FIRST], f"<{FIRST}>", False, None, "", len(req.token_ids), 0,
                             0.0, 1.0, 0.5)

    def _generate(self, req: DecodeRequest) -> AsyncIterator[Awaitable[Delta]]:
        fail_after = self._failure()
        self.requests.append(req)
        # a whole request (token_ids set) starts after the output it resumes; one after a prefill after the first
        start = len(req.output_token_ids) if req.token_ids else 1
        remaining = req.params.max_tokens - start

        # a handoff (sent with the prefill, sent_chars None) works out the first token's characters itself
        resumed = req.sent_chars if req.sent_chars is not None else len(FakeTokenizer().decode([FIRST]))

        async def stream() -> AsyncIterator[Awaitable[Delta]]:
            for i in range(remaining):
                if fail_after is not None and i == fail_after:
                    raise self.error("the decode worker died")
                token = FIRST + start + i
                last = i == remaining - 1
                final = FakeTokenizer().decode(list(range(FIRST, token + 1)))  # every output token's text
                yield asyncio.sleep(0, Delta([token], f"<{token}>", finished=last,
                                             finish_reason="length" if last else None,
                                             final_text=final if last else "", resumed_chars=resumed if i == 0 else 0))
        return stream()


def handle(name: str, role: Role, actor: FakeActor, tokenizer_json: str = "") -> WorkerHandle:
    info = WorkerInfo(name, role, 1, "fake", "fake", 16, 1000, 4096, 32000, 8, tokenizer_json, f"{name}:1")
    return WorkerHandle(name, role, actor, info, WorkerView(name, 1000, 8))


def pools_of(prefill: dict[str, FakeActor], decode: dict[str, FakeActor]) -> WorkerPools:
    handles = ([handle(n, Role.PREFILL, a) for n, a in prefill.items()]
               + [handle(n, Role.DECODE, a) for n, a in decode.items()])
    return WorkerPools(handles, RouterSettings(model="fake", mode="disaggregated").policy(16))


def request(max_tokens: int) -> Checked:
    return Checked("req-1", list(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0))


def assert_idle(pools: WorkerPools) -> None:
    """The router's own load numbers are back at zero on every worker."""
    loads = {w.name: (w.view.inflight, w.view.pending_tokens) for w in pools.by_name.values()}
    assert loads == {name: (0, 0) for name in loads}


async def collect(run: RequestRun, check: Callable[[RequestRun], None] = lambda _: None) -> list[Chunk]:
    """Every chunk of the run; `check(run)` after each chunk but the first (which may come from prefill)."""
    out: list[Chunk] = []
    async with contextlib.aclosing(run.chunks()) as chunks:
        async for chunk in chunks:
            if out:
                check(run)
            out.append(chunk)
    return out


def make_run(pools: WorkerPools, route: Route, max_tokens: int) -> RequestRun:
    return RequestRun(request(max_tokens), route, 0.0, pools, metrics=RouterMetrics(), prefill_timeout_s=5.0)


def only_the_current_decode_worker_is_loaded(run: RequestRun) -> None:
    if run.done:
        return
    want = {w.name: int(w is run.decode_worker) for w in run.pools.decode}
    assert {w.name: w.view.inflight for w in run.pools.decode} == want


@pytest.mark.parametrize("fails", [
    {"d0": [2]},  # one failover: d0 → d1
    {"d0": [2, None], "d1": [3]},  # d0 → d1 → d0 again (Ray restarted it)
    {"d0": [0], "d1": [0]},  # failures before an attempt streamed anything
])
def test_decode_failovers_lose_nothing_and_leave_no_load_behind(fails):
    actors = {name: FakeActor(fails.get(name)) for name in ("d0", "d1")}
    pools = pools_of({"p0": FakeActor()}, actors)
    run = make_run(pools, Route("p0", "d0", 0.0), 12)
    chunks = asyncio.run(collect(run, only_the_current_decode_worker_is_loaded))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == [FIRST + i for i in range(12)]  # every token once, in order
    assert "".join(c.text for c in chunks) == FakeTokenizer().decode(tokens)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and last.usage.completion_tokens == 12
    assert_idle(pools)
    # each decode attempt was told what the client already had: the tokens as output, the characters of their text;
    # the handoff's stream, opened with the prefill, before the first token existed, works it out itself
    for req in (r for a in actors.values() for r in a.requests):
        assert req.params.max_tokens == 12
        if req.token_ids:
            assert req.sent_chars == len(FakeTokenizer().decode(req.output_token_ids))
        else:
            assert req.sent_chars is None


def test_a_prefill_transfer_failure_moves_both_workers_and_leaves_no_load_behind():
    prefill = {"p0": FakeActor([0], error=TransferError), "p1": FakeActor()}
    pools = pools_of(prefill, {"d0": FakeActor(), "d1": FakeActor()})
    run = make_run(pools, Route("p0", "d0", 0.0), 6)
    chunks = asyncio.run(collect(run))
    assert [t for c in chunks for t in c.token_ids] == [FIRST + i for i in range(6)]
    timeline = chunks[-1].timeline
    assert timeline is not None and (timeline.prefill_worker, timeline.decode_worker) == ("p1", "d1")
    assert prefill["p0"].aborted and pools["d0"].actor.aborted  # the failed attempt is freed on both sides
    assert_idle(pools)


def test_a_run_that_every_worker_fails_aborts_everywhere_and_leaves_no_load_behind():
    actors = {name: FakeActor([1] * (MAX_FAILOVERS + 1)) for name in ("d0", "d1")}
    pools = pools_of({}, actors)
    run = make_run(pools, Route(None, "d0", 0.0), 12)
    with pytest.raises(WorkerFailed):
        asyncio.run(collect(run))
    assert sum(a.calls for a in actors.values()) == MAX_FAILOVERS + 1
    assert all(a.aborted for a in actors.values())
    assert_idle(pools)


def test_a_client_that_goes_away_after_a_failover_leaves_no_load_behind():
    actors = {"d0": FakeActor([2]), "d1": FakeActor()}
    pools = pools_of({"p0": FakeActor()}, actors)
    run = make_run(pools, Route("p0", "d0", 0.0), 50)

    async def read_some() -> None:
        chunks = run.chunks()
        for _ in range(6):  # past the failover, then the client leaves
            await anext(chunks)
        await chunks.aclose()
        # NOTE: at the close, not at asyncio.run's end (which closes every generator left open)
        assert actors["d1"].aborted
        assert_idle(pools)
    asyncio.run(read_some())
    assert run.decode_worker.name == "d1"


def test_the_router_counts_nothing_in_flight_after_failovers(tiny):
    """Through Router.stream: its own in-flight count and every worker's load return to zero."""
    actors = {"d0": FakeActor([3]), "d1": FakeActor()}
    tokenizer = tiny.tokenizer.to_json()
    handles = [handle("p0", Role.PREFILL, FakeActor(), tokenizer)]
    handles += [handle(name, Role.DECODE, actor, tokenizer) for name, actor in actors.items()]
    router = Router(handles, None, RouterSettings(model="tiny", mode="disaggregated"))

    async def run() -> list[int]:
        return [t async for c in router.stream(request(10)) for t in c.token_ids]
    assert asyncio.run(run()) == [FIRST + i for i in range(10)]
    assert router.inflight == 0
    assert_idle(router.pools)
    assert router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) == 1
