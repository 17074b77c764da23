"""A TP group's TCPStore as its ranks meet on it outside the process groups (the shared memory's and the pipes'
set-ups): a counter every rank bumps, waited for with the group's timeout."""

from __future__ import annotations

import time
from typing import Any


def wait_count(store: Any, key: str, want: int, timeout_s: float, what: str) -> None:
    """Until the counter `key` reaches `want` (ranks add 1 to it with `store.add(key, 1)`); RuntimeError saying
    `what` did not happen within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.001)
