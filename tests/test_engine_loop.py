"""The engine loop hands its lock over between two steps to whoever waits for it (`call` and `between_steps`)."""

from __future__ import annotations

import threading
import time

from engine import SamplingParams
from engine.loop import EngineLoop
from tests.helpers import make_engine, random_prompts


def test_a_holder_of_between_steps_gets_the_engine_within_a_step_while_the_loop_is_busy(tiny):
    steps = [0]
    loop = EngineLoop(make_engine(tiny), name="test", on_step=lambda t: steps.__setitem__(0, steps[0] + 1))
    try:
        prompts = random_prompts(4, [40])
        busy = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
        loop.call(lambda e: [e.add_request(f"busy{i}", p, busy) for i, p in enumerate(prompts)])
        time.sleep(0.2)
        waited = []
        for _ in range(30):
            before = steps[0]
            with loop.between_steps:
                waited.append(steps[0] - before)
                assert loop.lock._is_owned()  # type: ignore[attr-defined]
            time.sleep(0.005)
        assert steps[0] > 0 and max(waited) <= 1, waited  # at most the step that was running when it asked
        # reentrant, and `call` nests inside it on the same thread (the receiver commits while holding it)
        with loop.between_steps:
            assert loop.call(lambda e: e.has_unfinished_requests())
        done = threading.Event()
        threading.Thread(target=lambda: (loop.call(lambda e: None), done.set()), daemon=True).start()
        assert done.wait(5)
    finally:
        loop.close()


def test_try_call_runs_at_once_on_an_idle_engine_and_declines_while_a_step_holds_it(tiny):
    """An event loop adds a request to an idle engine itself (no thread hop), and never waits for a busy one."""
    loop = EngineLoop(make_engine(tiny), name="test")
    try:
        ran: list[str] = []
        assert loop.try_call(lambda e: ran.append(threading.current_thread().name))
        assert ran == [threading.current_thread().name]  # on the caller's thread, before it returned
        prompt = random_prompts(1, [30])[0]
        assert loop.try_call(lambda e: e.add_request("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
        deadline = time.monotonic() + 10
        while loop.call(lambda e: e.has_unfinished_requests()):  # the loop was woken: it steps the request through
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # another thread has the engine (as the loop does during a step)
            with loop.lock:
                held.set()
                release.wait(10)

        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(5)
        assert not loop.try_call(lambda e: ran.append("busy"))
        release.set()
        assert "busy" not in ran
    finally:
        loop.close()
