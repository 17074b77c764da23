"""Core lending (cluster/cores.py): a busy worker steps on its idle peers' cores and gives them back within a step.

The two-process test runs two real engine loops (the tiny model) in two processes pinned to one core each, sharing
one share file, as a prefill and a decode worker on one node do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest

from cluster.cores import CoreShare, Share, Slot, plan
from pdcluster.config import ClusterConfig, ConfigError

C = frozenset


@pytest.mark.parametrize("slots, me, want", [
    # 1 prefill + 1 decode, one core each (deploy/bench-disagg.yaml)
    ({0: Slot(1, 1, C({0}), True), 1: Slot(2, 1, C({1}), False)}, 0, Share(2, C({0, 1}))),
    ({0: Slot(1, 1, C({0}), True), 1: Slot(2, 1, C({1}), True)}, 0, Share(1, C({0}))),
    ({0: Slot(1, 1, C({0}), False), 1: Slot(2, 1, C({1}), False)}, 1, Share(2, C({0, 1}))),
    # two busy workers split the idle ones' cores in slot order
    ({0: Slot(1, 1, C({0}), True), 1: Slot(2, 1, C({1}), True), 2: Slot(3, 2, C({2, 3}), False)}, 0,
     Share(2, C({0, 2}))),
    ({0: Slot(1, 1, C({0}), True), 1: Slot(2, 1, C({1}), True), 2: Slot(3, 2, C({2, 3}), False)}, 1,
     Share(2, C({1, 3}))),
    # an idle worker on a core a busy one also owns lends nothing
    ({0: Slot(1, 2, C({0, 1}), True), 1: Slot(2, 1, C({1}), False)}, 0, Share(2, C({0, 1}))),
    # unpinned workers lend their thread counts
    ({0: Slot(1, 2, C(), True), 1: Slot(2, 2, C(), False), 2: Slot(3, 1, C(), True)}, 2, Share(2, C())),
])
def test_plan_deals_idle_cores_to_busy_workers(slots: dict[int, Slot], me: int, want: Share) -> None:
    assert plan(me, slots) == want


def test_lending_is_refused_on_cuda_pools_naming_the_field(tmp_path: Any) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("decode:\n  device: cuda\n  num_gpus: 1\n  lend_idle_cores: true\n")
    with pytest.raises(ConfigError, match="decode.lend_idle_cores: lends CPU cores"):
        ClusterConfig.from_yaml(path)


def test_a_dead_workers_slot_is_reclaimed_and_never_counts_as_busy(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=_join_busy_and_exit, args=(str(tmp_path),))
    dead.start()
    dead.join(30)
    assert dead.exitcode == 0
    share = CoreShare.join("g", (), 1, lend=False, directory=str(tmp_path))
    try:
        assert share.index == 0 and list(share.slots()) == [0]  # the dead process's busy slot, taken over
    finally:
        share.leave()


def test_a_step_borrows_only_with_enough_prompt_work_left(tmp_path: Any) -> None:
    """Short work ran slower on borrowed cores (cluster/cores.py, LEND_MIN_PROMPT_TOKENS): below `min_tokens` a
    step keeps its own share even with the peer idle, and gives back what the previous step borrowed."""
    import torch

    threads = torch.get_num_threads()
    me = CoreShare.join("g", (), 1, lend=True, min_tokens=256, directory=str(tmp_path))
    peer = CoreShare.join("g", (), 1, lend=False, directory=str(tmp_path))  # joined, idle
    try:
        assert me.before_step(255) == me.own == Share(1, frozenset())
        assert me.before_step(256) == Share(2, frozenset()) and me.lent_steps == 1
        assert me.before_step(40) == me.own and me.current == me.own and me.lent_steps == 1
        peer.before_step(0)  # the peer busy: nothing to borrow, however long the prompt
        assert me.before_step(10_000) == me.own
    finally:
        me.leave()
        peer.leave()
        torch.set_num_threads(threads)


def _join_busy_and_exit(directory: str) -> None:
    CoreShare.join("g", (), 1, lend=False, directory=directory).before_step(0)


# ---- two engine loops in two processes ------------------------------------------------------------------------
def _peer(directory: str, core: int, conn: Any) -> None:
    """A worker's engine loop on `core` with core lending; serves the test's commands over `conn`."""
    os.sched_setaffinity(0, {core})  # NOTE: as pin_cpus at an actor's start (one core, one thread)
    import threading

    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import load_model
    from engine.loop import EngineLoop

    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=512, num_threads=1, enable_prefix_caching=False))
    share = CoreShare.join("test", (core,), 1, lend=True, min_tokens=0, directory=directory)
    steps: list[tuple[float, float, int, int, list[int]]] = []  # before, after reading the peers; what it applied
    idles: list[float] = []

    def before_step() -> None:
        t0 = time.monotonic()
        s = share.before_step(engine.scheduler.pending_prompt_tokens())
        steps.append((t0, time.monotonic(), s.threads, torch.get_num_threads(), sorted(os.sched_getaffinity(0))))

    def on_idle() -> None:
        idles.append(time.monotonic())
        share.idle()

    loop = EngineLoop(engine, name=f"peer{core}", before_step=before_step, on_idle=on_idle)
    done: dict[str, threading.Event] = {}
    tokens: dict[str, list[int]] = {}

    def generate(rid: str, prompt: list[int], max_tokens: int) -> None:
        done[rid] = threading.Event()

        def sink(out: Any) -> None:
            if out.finished:
                tokens[rid] = out.token_ids
                done[rid].set()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        loop.call(lambda e: (e.add_request(rid, prompt, params), loop.attach(rid, sink)))

    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "start":
            generate(*args)
            conn.send(None)
        elif cmd == "generate":
            generate(*args)
            done[args[0]].wait(60)
            conn.send(tokens.get(args[0]))
        elif cmd == "abort":
            loop.abort(args[0])
            conn.send(None)
        elif cmd == "cpus":
            conn.send(sorted(os.sched_getaffinity(0)))
        elif cmd == "records":
            with loop.lock:
                conn.send((list(steps), list(idles)))
        else:
            loop.close()
            share.leave()
            conn.send(None)
            return


class _Peer:
    def __init__(self, ctx: Any, directory: str, core: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer, args=(directory, core, child), daemon=True)
        self.proc.start()

    def ask(self, *cmd: object) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(90), f"peer did not answer {cmd[0]}"
        return self.conn.recv()

    def steps_since(self, t: float) -> list[tuple[float, float, int, int, list[int]]]:
        return [s for s in self.ask("records")[0] if s[0] >= t]

    def wait_steps(self, t: float, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.steps_since(t)) < n:
            assert time.monotonic() < deadline, "the peer's loop made no steps"
            time.sleep(0.01)


def test_a_busy_worker_takes_an_idle_peers_core_and_gives_it_back_within_a_step(tmp_path: Any,
                                                                               monkeypatch: Any) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("core lending needs two cores")
    from tests.helpers import random_prompts, wait_for

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # NOTE: as a worker's environment (pdcluster/launch.py)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    a, b = _Peer(ctx, str(tmp_path), cores[0]), _Peer(ctx, str(tmp_path), cores[1])
    try:
        assert a.conn.poll(90) and a.conn.recv() == "ready"
        assert b.conn.poll(90) and b.conn.recv() == "ready"
        prompt, long_a, long_b = random_prompts(3, [300, 40, 40], vocab=1000, seed=3)
        lent_view = [cores[0], cores[1]]

        # 1. the peer idle: every step of A on both cores with two threads
        t = time.monotonic()
        lent_tokens = a.ask("generate", "lent", prompt, 24)
        assert {(s[2], s[3], tuple(s[4])) for s in a.steps_since(t)} == {(2, 2, tuple(lent_view))}
        assert wait_for(lambda: a.ask("cpus") == [cores[0]])  # idle again: A keeps only its own core

        # 2. A busy on both cores; B gets work: A is back on its own core from its next step on
        a.ask("start", "long-a", long_a, 100_000)
        a.wait_steps(t := time.monotonic(), 3)
        b.ask("start", "long-b", long_b, 100_000)
        b.wait_steps(t, 1)
        # NOTE: B marks itself busy inside its first step's before_step, between that step's two timestamps: A's
        # steps that read the file before the first one cannot have seen it, those that start after the second must
        b_marking, b_busy = b.steps_since(t)[0][:2]
        a.wait_steps(b_busy, 3)
        a_steps = a.ask("records")[0]
        before = [s for s in a_steps if t <= s[0] and s[1] < b_marking]
        after = [s for s in a_steps if s[0] > b_busy]
        assert before and {s[2:4] for s in before} == {(2, 2)}
        assert {(s[2], s[3], tuple(s[4])) for s in after} == {(1, 1, (cores[0],))}
        a.ask("abort", "long-a")

        # 3. while B stays busy, A computes the same prompt on one core: the same greedy tokens
        t = time.monotonic()
        assert a.ask("generate", "own", prompt, 24) == lent_tokens
        assert {s[2:4] for s in a.steps_since(t)} == {(1, 1)}
        assert not [i for i in b.ask("records")[1] if i >= b_busy], "B went idle meanwhile: the check proved nothing"
        b.ask("abort", "long-b")
        for p in (a, b):
            p.ask("close")
            p.proc.join(10)
        assert not os.listdir(tmp_path)  # the node's last worker removed the share file
    finally:
        for p in (a, b):
            if p.proc.is_alive():
                p.conn.send(("close",))
                p.proc.join(10)
            if p.proc.is_alive():
                p.proc.kill()
