"""A TP group fails as a unit, without Ray: the engine loop hands a dead rank's TPGroupError to `on_fatal` (a worker
ends its process there) instead of aborting the requests, and a follower whose rank 0 was SIGKILLed leaves too.

tests/test_tensor_parallel_cluster.py has the same through `pdcluster serve` (a stream that fails over).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from cluster.process import pid_alive
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop import EngineLoop
from engine.output import RequestOutput
from engine.parallel.launch import TPGroupError
from tests.helpers import random_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_dead_rank_reaches_on_fatal_and_no_request_hears_abort(tiny) -> None:
    engine = LLMEngine(tiny, EngineConfig(num_blocks=128, num_threads=1, tensor_parallel_size=2))
    fatal: list[BaseException] = []
    failed = threading.Event()
    outputs: list[RequestOutput] = []
    loop = EngineLoop(engine, name="tp-test", on_fatal=lambda e: (fatal.append(e), failed.set()))
    try:
        params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        loop.call(lambda e: e.add_request("a", random_prompts(1, [20], seed=3)[0], params))
        loop.attach("a", outputs.append)
        deadline = time.monotonic() + 30
        while sum(len(o.new_token_ids) for o in outputs) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = engine.runner.followers.procs[0].process.pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        assert failed.wait(30), "the loop never reported the group's failure"
        assert isinstance(fatal[0], TPGroupError) and f"rank 1 (pid {pid}): killed by SIGKILL" in str(fatal[0])
        # NOTE: the request is left as it was: an "abort" would end the client's stream, where failover resumes it
        assert not any(o.finished for o in outputs)
        time.sleep(0.2)
        assert len(fatal) == 1  # once: the loop stopped stepping
    finally:
        loop.close()
        engine.close()


ORPHANS = {
    # a follower idle in the step broadcast: the collective fails once rank 0's sockets close
    "in a collective": """
import time
from engine import LLM
if __name__ == "__main__":
    llm = LLM("tiny", tensor_parallel_size=2, num_blocks=64, num_threads=1)
    print(" ".join(str(f.process.pid) for f in llm.engine.runner.followers.procs), flush=True)
    time.sleep(600)
""",
    # a follower in no collective (e.g. loading its shard): only its parent watch notices
    "outside any collective": """
import multiprocessing, os, time
from engine.parallel.follower import watch_parent
def follower():
    watch_parent(1)
    print(os.getpid(), flush=True)  # NOTE: once it watches: a parent killed before that is not what this tests
    time.sleep(600)
if __name__ == "__main__":
    multiprocessing.get_context("spawn").Process(target=follower, daemon=True).start()
    time.sleep(600)
"""}


@pytest.mark.parametrize("where", ORPHANS)
def test_a_follower_leaves_when_its_rank_0_process_is_sigkilled(tmp_path, where: str) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(ORPHANS[where])
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids += [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and pid_alive(pids[0])
        proc.kill()  # NOTE: SIGKILL: no finalizer of rank 0 runs, nothing stops its followers
        proc.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pids[0]), "the follower outlived its rank 0"
    finally:
        proc.kill()
        for pid in filter(pid_alive, pids):  # NOTE: a failed check leaves no follower behind
            os.kill(pid, signal.SIGKILL)
