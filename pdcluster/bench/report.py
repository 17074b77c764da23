"""What every bench command does with its figures: save them as JSON, print a table (or the JSON), log to stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def machine() -> dict[str, Any]:
    """What every bench records about where it ran: CPU model, cores, torch and Python versions."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def log(bench: str, msg: str) -> None:
    print(f"[bench {bench}] {msg}", file=sys.stderr, flush=True)


def emit(bench: str, figures: dict[str, Any], out: str, as_json: bool,
         format_table: Callable[[dict[str, Any]], str]) -> int:
    """Save `figures` to `out`, print the table (or one JSON object with `as_json`); returns the exit code."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(figures, f, indent=2)
    print(json.dumps(figures) if as_json else format_table(figures))
    log(bench, f"saved {out}")
    return 0
