"""A real Router over a real tokenizer whose workers are never called: for the fronts' own refusals and limits."""

from __future__ import annotations

from typing import Any


def unit_router(loaded: Any) -> Any:
    """A real Router and its validator over `loaded`'s tokenizer, for requests that never reach a worker (actors:
    None; no Redis)."""
    from cluster.messages import Role, WorkerInfo
    from router.core import Router
    from router.policy import WorkerView
    from router.pools import WorkerHandle
    from router.settings import RouterSettings

    handles = []
    for name, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)):
        info = WorkerInfo(name, role, 1, "tiny", "tiny", 16, 1000, 2048, loaded.config.vocab_size, 8,
                          loaded.tokenizer.to_json(), f"{name}:1")
        handles.append(WorkerHandle(name, role, None, info, WorkerView(name, 1000, 8)))
    return Router(handles, None, RouterSettings(model="tiny", mode="disaggregated"))
