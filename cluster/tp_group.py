"""A worker's tensor-parallel group seen from rank 0: its followers' pids, and ending the process when it failed.

The followers are Ray actors of the worker's placement group when the launcher gave it one (cluster/tp_ranks.py),
else processes of the worker's (the engine's own launcher); both are the engine's `FollowerGroup` here.

NOTE: a TP group is one worker: half of it must not serve on. A worker whose group failed ends its process, which
makes it a dead worker like any other: the router fails its requests over and Ray restarts the actor as a unit.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import NoReturn

from engine.parallel.launch import FollowerGroup, TPGroupError
from engine.parallel.runner import TPModelRunner

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 70  # the process's exit code when its engine can never step again (EX_SOFTWARE)


def followers(runner: object) -> FollowerGroup | None:
    """The followers of `runner`'s TP group; None at TP 1 (a plain ModelRunner)."""
    return runner.followers if isinstance(runner, TPModelRunner) else None


def end_process(name: str, error: BaseException, runner: object) -> NoReturn:
    """The engine can never step again (a rank of its TP group died): end this process.

    NOTE: ending the process makes it a dead worker like any other: the router fails its requests over (streams
    resume elsewhere, no token lost or repeated) and Ray restarts the actor, which starts a fresh group as a unit (the
    pool's `max_restarts`). The followers still running are killed first (os._exit runs no finalizer; follower
    processes would leave on their own within a parent poll, rank actors once Ray sees their owner gone).
    """
    log.critical("%s: %s; ending this worker's process (exit code %d) so that its requests fail over and Ray "
                 "restarts it", name, error, EXIT_ENGINE_FAILED)
    group = followers(runner)
    if group is not None:
        group.kill()
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_ENGINE_FAILED)


def check(name: str, runner: object, closed: threading.Event) -> None:
    """End this process if its TP group failed or lost a rank while no step noticed (an idle engine, or a KV
    write into the pool that failed on a receiver's thread): the next request would only fail over anyway."""
    if not isinstance(runner, TPModelRunner) or closed.is_set():  # NOTE: TP 1; or closing, on purpose
        return
    failure = runner.failure
    dead = [] if failure is not None else runner.followers.dead()
    if failure is not None or dead:
        end_process(name, failure or TPGroupError(f"tensor-parallel group of {runner.group.size} lost "
                                                  f"{'; '.join(dead)}"), runner)


def follower_pids(runner: object) -> list[int]:
    """The pids of a TP group's followers (ranks 1 .. n-1); empty at TP 1."""
    group = followers(runner)
    return [] if group is None else group.pids()
