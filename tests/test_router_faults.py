"""The router's own fault handling without a cluster: deadlines, clock skew, the front door's caps."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from cluster.messages import WorkerLoad
from cluster.prefix_index import PrefixIndex
from engine.errors import InvalidRequestError
from router.errors import DeadlineExceeded, Overloaded, Status, status_of
from router.pinger import HeartbeatAges
from router.validate import PromptRequest, RequestValidator
from tests.unit_router import unit_router


def run_until_refused(router, req, budget_s: float) -> BaseException:
    async def go() -> BaseException:
        try:
            async for _ in router.stream(req, budget_s=budget_s):
                pass
        except Exception as e:  # noqa: BLE001 - the refusal under test
            return e
        raise AssertionError("the request was admitted")
    return asyncio.run(go())


def test_a_deadline_an_idle_cluster_cannot_meet_is_deadline_exceeded_not_overload(tiny):
    router = unit_router(tiny)
    req = RequestValidator(router.info).prompt(PromptRequest("r1", prompt_token_ids=[5] * 1000))
    err = run_until_refused(router, req, 0.05)
    assert isinstance(err, DeadlineExceeded) and status_of(err)[0] is Status.DEADLINE_EXCEEDED
    assert router.inflight == 0
    # NOTE: the same deadline missed only because of the queue ahead is load: the client may retry elsewhere (both
    # pools busy: with only the prefill pool queued, the router would place the prompt on the decode pool)
    for name in ("prefill-0", "decode-0"):
        router.pools[name].view.pending_tokens = 200_000
    err = run_until_refused(router, req, 5.0)
    assert isinstance(err, Overloaded) and status_of(err)[0] is Status.RESOURCE_EXHAUSTED
    assert router.inflight == 0


def test_heartbeat_ages_use_the_routers_clock_only():
    ages = HeartbeatAges()
    # NOTE: worker clocks 10 s ahead and 10 s behind: a fresh beat is young whatever it says
    assert ages.update({"a": (1, 1e9 + 10), "b": (1, 1e9 - 10)}, now=100.0) == {"a": 0.0, "b": 0.0}
    assert ages.update({"a": (1, 1e9 + 10.5), "b": (1, 1e9 - 10)}, now=103.0) == {"a": 0.0, "b": 3.0}
    assert ages.update({"a": (1, 1e9 + 10.5), "b": (2, 1e9 - 10)}, now=106.0) == {"a": 3.0, "b": 0.0}
    assert ages.update({"b": (2, 1e9 - 10)}, now=107.0) == {"b": 1.0}  # a's key expired: forgotten
    assert ages.age("a") is None


@pytest.fixture(scope="module")
def redis_client() -> Iterator[object]:
    from pdcluster.redis_server import EmbeddedRedis, connect

    with EmbeddedRedis() as server:
        client = connect(server.url)
        yield client
        client.close()


def test_workers_whose_clocks_are_10_s_off_are_routed_to_and_health_stays_green(tiny, redis_client):
    router = unit_router(tiny)
    prefix = f"t{uuid.uuid4().hex[:12]}"
    router.index = PrefixIndex(redis_client, prefix)
    stop = threading.Event()

    def beat(name: str, role: str, skew_s: float) -> None:
        index = PrefixIndex(redis_client, prefix)
        index.clock = lambda: time.time() + skew_s  # this node's clock is off
        epoch = index.register_worker(name)
        while not stop.is_set():
            index.heartbeat(name, epoch, role, f"{name}:1", WorkerLoad(num_blocks=1000, free_blocks=1000))
            stop.wait(0.2)

    threads = [threading.Thread(target=beat, args=("prefill-0", "prefill", 10.0)),
               threading.Thread(target=beat, args=("decode-0", "decode", -10.0))]
    for t in threads:
        t.start()

    async def watch() -> tuple[bool, set[str], float]:
        task = asyncio.create_task(router._refresh_loads())  # NOTE: no pinger: these workers have no actors
        try:
            await asyncio.sleep(1.5)
            return router.healthy(), {n for n in router.pools.by_name if router.pools.is_up(n)}, \
                (await router.status()).workers[1].heartbeat_age_s
        finally:
            task.cancel()
    try:
        healthy, up, age = asyncio.run(watch())
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert healthy and up == {"prefill-0", "decode-0"}
    assert age < 1.0  # decode-0's beat is young by the router's clock, though it says it is 10 s old
    route = router.pools.route(100, 8, {})
    assert (route.prefill, route.decode) == ("prefill-0", "decode-0")


# ---- the front door's caps ----------------------------------------------------------------------------------
def test_stop_token_ids_are_capped_naming_the_field(tiny):
    from router.validate import MAX_STOP_TOKEN_IDS, SamplingFields

    v = RequestValidator(unit_router(tiny).info)
    ok = v.prompt(PromptRequest("r", prompt="hi", sampling=SamplingFields(stop_token_ids=[3] * MAX_STOP_TOKEN_IDS)))
    assert len(ok.params.stop_token_ids) == MAX_STOP_TOKEN_IDS
    for check in (lambda: v.prompt(PromptRequest("r", prompt="hi", sampling=SamplingFields(
                      stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)))),
                  lambda: v.precheck(2, 0, 0, MAX_STOP_TOKEN_IDS + 1)):
        with pytest.raises(InvalidRequestError) as info:
            check()
        assert info.value.field == "sampling.stop_token_ids"


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(tiny):
    from router.validate import MAX_PROMPT_CHARS

    v = RequestValidator(unit_router(tiny).info)
    # NOTE: no token stands for more than max_token_chars characters, so more than (context x that) cannot fit
    assert v.max_prompt_chars == (2048 - 1) * v.tokenizer.max_token_chars() < MAX_PROMPT_CHARS
    calls = []
    v.tokenizer.encode = lambda *a, **k: calls.append(a) or [1]  # type: ignore[method-assign]
    for check, field in ((lambda: v.precheck(v.max_prompt_chars + 1, 0, 0, 0), "prompt"),
                         (lambda: v.precheck(0, 2048, 0, 0), "prompt_token_ids"),
                         (lambda: v.precheck(0, 0, 1025, 0), "messages"),
                         (lambda: v.prompt(PromptRequest("r", prompt="x" * (v.max_prompt_chars + 1))), "prompt")):
        with pytest.raises(InvalidRequestError) as info:
            check()
        assert info.value.field == field
    assert calls == []  # nothing was tokenized
    v.precheck(v.max_prompt_chars, 2047, 1024, 1024)  # at the limits: accepted


def test_admission_slots_count_requests_being_read_and_pass_to_the_stream(tiny):
    router = unit_router(tiny)
    router.max_inflight = 2
    a, b = router.admit("a"), router.admit("b")
    with pytest.raises(Overloaded):
        router.admit("c")
    a.release()
    a.release()  # twice: nothing
    assert router.pending == 1
    c = router.admit("c")
    req = RequestValidator(router.info).prompt(PromptRequest("r", prompt_token_ids=[5] * 1000))

    async def refused_by_deadline() -> None:
        # NOTE: the slot passes to the stream (no second check against the full router), which then refuses
        with pytest.raises(DeadlineExceeded):
            async for _ in router.stream(req, budget_s=0.01, admission=c):
                pass
    asyncio.run(refused_by_deadline())
    assert not c.held and router.pending == 1 and router.inflight == 0
    b.release()
    assert router.pending == 0


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"model": "tiny", "prompt": "hi", "logit_bias": ' + b'{"a":' * 900 + b"1"
                                  + b"}" * 901], ids=["list", "prompt", "logit_bias"])
def test_deeply_nested_json_is_a_400_naming_the_body(tiny, body):
    from aiohttp import web

    from router.openai_api import OpenAIFront
    from router.openai_models import CompletionRequest

    front = OpenAIFront(unit_router(tiny), "tiny", frozenset())
    try:
        front._decode(body, CompletionRequest)
    except InvalidRequestError as e:
        assert e.field.split(".")[0] in ("body", "prompt", "logit_bias"), e
    except web.HTTPException:
        pytest.fail("not an OpenAI error")
    # NOTE: any other exception (RecursionError: a 500 with a traceback) fails the test


def test_the_ignored_field_label_is_bounded():
    from router.openai_models import IgnoredFieldLog

    log = IgnoredFieldLog()
    assert log.note("x" * 1_000_000) == "other"
    assert log.note("frequency_bias") == "frequency_bias"


def test_an_http_body_being_read_holds_an_admission_slot(tiny):
    from router.openai_api import start_http

    router = unit_router(tiny)
    router.max_inflight = 1

    async def go() -> tuple[int, bytes]:
        runner, port = await start_http(router, host="127.0.0.1", port=0, model_name="tiny")
        try:
            slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
            slow_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # ... and the rest never comes
            await slow_w.drain()
            for _ in range(100):
                if router.pending:
                    break
                await asyncio.sleep(0.02)
            pending = router.pending
            r, w = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            answer = await r.read()
            w.close()
            slow_w.close()
            return pending, answer
        finally:
            await runner.cleanup()
    pending, answer = asyncio.run(go())
    assert pending == 1
    assert answer.startswith(b"HTTP/1.1 429") and b"max_inflight" in answer, answer[:300]
    assert router.pending == 0


# ---- the relay between a run and its client ---------------------------------------------------------------
def test_a_client_that_stops_reading_pauses_the_run_then_cuts_it_off():
    from router.relay import relayed

    made: list[int] = []
    closed = asyncio.Event()
    stalls: list[int] = []
    sizes: list[int] = []

    async def run():  # the request's run: 1,000 chunks as fast as they are taken
        try:
            for i in range(1000):
                made.append(i)
                yield i
        finally:
            closed.set()  # the run's finally is what aborts the request on the workers

    async def client() -> list[int]:
        got = []
        # NOTE: closed when left, as the fronts do (Router.stream_within)
        async with contextlib.aclosing(relayed(run(), 4, 0.3, "r", sizes.append, lambda: stalls.append(1))) as out:
            async for chunk in out:
                got.append(chunk)
                await asyncio.sleep(3600)  # its write never completes: the client stopped reading
        return got

    async def go() -> None:
        task = asyncio.create_task(client())
        with pytest.raises(asyncio.CancelledError):
            await task  # NOTE: the relay cancels the front's task blocked on the client
        assert closed.is_set()
    asyncio.run(go())
    assert stalls == [1]
    assert len(made) <= 4 + 2  # the run paused at the buffer's limit: nothing piled up
    assert sum(sizes) == 0 and max(itertools.accumulate(sizes)) == 4  # the gauge went back to zero


@pytest.mark.parametrize("n", [1, 3])
def test_a_front_task_that_ends_with_its_stream_left_open_still_closes_every_run(n):
    """The front's task is cancelled while the stream is suspended at a yield and is never closed (what gRPC did
    to a generator handler cancelled inside its write): the runs are closed with the task, not at a GC."""
    from engine.sampling_params import SamplingParams
    from router.fanout import fan_out
    from router.relay import relayed
    from router.results import Chunk
    from router.validate import Checked

    closed: set[str] = set()
    seen_all: set[int] = set()
    kept = []  # NOTE: holds the stream, as a framework's frame would: no refcount finalizer closes it

    async def run(c: Checked):
        try:
            for i in range(1000):
                yield Chunk(c.request_id, [i], "x")
        finally:
            closed.add(c.request_id)

    async def front() -> None:
        checked = Checked("r", [1, 2, 3], SamplingParams(n=n, max_tokens=1000))
        stream = fan_out(lambda c: relayed(run(c), 4, 3600, c.request_id), checked)
        kept.append(stream)
        async for chunk in stream:  # NOTE: no aclosing: left suspended when the task is cancelled below
            seen_all.add(chunk.index)
            if len(seen_all) == n:
                break
        await asyncio.sleep(3600)  # the write that the cancel lands in

    async def go() -> None:
        task = asyncio.create_task(front())
        while not kept or len(seen_all) < n:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # NOTE: a bound for a hang; the cancelled pumps close their runs within a few turns
            if len(closed) == n:
                break
            await asyncio.sleep(0.01)
        # NOTE: asserted before asyncio.run's end, which closes every open generator itself
        assert closed == ({"r"} if n == 1 else {"r", "r-1", "r-2"})
        assert kept  # still referenced here: it was the task's end that closed the runs
    asyncio.run(go())


def test_a_pump_that_misses_its_cancel_still_stops_and_closes_the_run():
    """A cancel can be lost (asyncio.wait_for before Python 3.12 returns a result that came in with it): the pump
    must stop all the same when the front goes away, not read on into a buffer nobody reads until the stall cut."""
    from router.relay import relayed

    closed = asyncio.Event()
    lost = []

    async def run():
        try:
            for i in range(1000):
                try:
                    await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    lost.append(i)  # NOTE: swallowed: the run goes on as if never cancelled
                yield i
        finally:
            closed.set()

    async def front() -> None:
        out = relayed(run(), 4, 3600, "r")
        assert [await anext(out), await anext(out)] == [0, 1]
        await asyncio.wait_for(out.aclose(), 10)  # NOTE: a bound for a hang (the stall cut is an hour away)
        assert closed.is_set()
    asyncio.run(front())
    assert lost  # the cancel did reach the run, which lost it


def test_a_slow_client_gets_every_chunk_in_order_without_being_cut_off():
    from router.relay import relayed

    async def run():
        for i in range(40):
            yield i

    async def client() -> list[int]:
        got = []
        async for chunk in relayed(run(), 4, 1.0):
            got.append(chunk)
            await asyncio.sleep(0.005)
        return got
    assert asyncio.run(client()) == list(range(40))


def test_a_client_that_falls_behind_gets_the_piled_up_tokens_joined_in_order():
    from router.relay import relayed
    from router.results import Chunk, Usage

    async def run():
        yield Chunk("r", [1], "a", prompt_logprobs=[None])
        for i in range(2, 40):
            yield Chunk("r", [i], chr(96 + i % 26), index=i % 2 if 20 <= i < 24 else 0)
        yield Chunk("r", [40], "!", finish_reason="length", usage=Usage(3, 40))

    async def client() -> list[Chunk]:
        got = []
        async for chunk in relayed(run(), 64, 1.0, join=Chunk.joined):
            got.append(chunk)
            await asyncio.sleep(0.005)  # NOTE: writes slower than the run makes chunks: they pile up
        return got
    got = asyncio.run(client())
    assert len(got) < 20  # fewer, larger messages
    for index in (0, 1):  # NOTE: chunks of another choice (n > 1) are never joined into this one's
        ids = [t for c in got if c.index == index for t in c.token_ids]
        assert ids == [i for i in range(1, 41) if (i % 2 if 20 <= i < 24 else 0) == index]
    assert got[0].prompt_logprobs == [None] and got[-1].finish_reason == "length" and got[-1].usage == Usage(3, 40)
    assert all(not c.finish_reason for c in got[:-1])


def test_a_failure_of_the_run_reaches_the_client_after_the_chunks_before_it():
    from router.relay import relayed

    async def run():
        yield 1
        yield 2
        raise TimeoutError

    async def client() -> list[int]:
        got = []
        with pytest.raises(TimeoutError):
            async for chunk in relayed(run(), 4, 1.0):
                got.append(chunk)
        return got
    assert asyncio.run(client()) == [1, 2]


def test_n_choices_for_a_client_that_stops_reading_are_cut_off_and_closed():
    from engine.sampling_params import SamplingParams
    from router.fanout import fan_out
    from router.relay import relayed
    from router.results import Chunk
    from router.validate import Checked

    made: dict[str, int] = {}
    closed: set[str] = set()

    async def run(c: Checked):  # one choice's run: chunks as fast as they are taken
        try:
            for i in range(1000):
                made[c.request_id] = i + 1
                yield Chunk(c.request_id, [i], "x")
        finally:
            closed.add(c.request_id)  # the run's finally is what aborts the choice on the workers

    async def client() -> None:
        checked = Checked("r", [1, 2, 3], SamplingParams(n=3, max_tokens=1000))
        async with contextlib.aclosing(fan_out(lambda c: relayed(run(c), 4, 0.3, c.request_id), checked)) as out:
            seen = set()
            async for chunk in out:
                seen.add(chunk.index)
                if len(seen) == 3:  # every choice is running: now the client stops reading
                    await asyncio.sleep(3600)  # its write never completes

    async def go() -> None:
        task = asyncio.create_task(client())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)  # NOTE: a choice's relay cut it off: the whole response ends
    asyncio.run(go())
    assert set(made) == closed == {"r", "r-1", "r-2"}  # every choice's run was closed (aborted on its workers)
    # nothing piled up: what the client read, the fan-out's slots, each choice's relay buffer and the chunk in hand
    assert sum(made.values()) <= 40
