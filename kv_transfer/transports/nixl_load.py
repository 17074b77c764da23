"""The NIXL package of this process, loaded on first use, and whether there is one: what the router's process asks
(deploy-time checks choose grpc without NIXL) without the agent, the engine or torch (kv_transfer/transports/
nixl_agent.py makes the agent with it)."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

# NOTE: measured with two processes on one host (issue 30): UCX's TCP transport as shipped moves 0.13-0.8x raw
# TCP; with 64 KiB send and 256 KiB receive segments it moves 0.6-2x. Same-host pairs use cma (zero copy) anyway.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "64K", "UCX_TCP_RX_SEG_SIZE": "256K"}
MODULES = ("nixl_cu13", "nixl_cu12", "nixl")

_module: ModuleType | None = None


def load() -> ModuleType:
    """The NIXL package; raises ImportError naming what is missing."""
    global _module
    if _module is not None:
        return _module
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    errors = []
    for name in MODULES:
        try:
            _module = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NOTE: it logs every agent and backend at INFO, on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return _module
    raise ImportError("no NIXL package importable (" + "; ".join(errors) + "); scripts/install.sh installs nixl-cu12")


def unavailable() -> str | None:
    """Why the nixl transport cannot run in this process (None: it can)."""
    try:
        load()
    except ImportError as e:
        return str(e)
    return None
