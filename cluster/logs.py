"""Logs that follow a request across processes: every record carries the component and the request id.

The router, each worker actor and the KV transfer threads set `REQUEST_ID` while they work on a request; a filter
copies it (and the process's component name, e.g. "router" or "decode-0") onto every record. `configure` picks
plain text for people or one JSON object per line for log pipelines (`logging.format: json`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("pdcluster_request_id", default="")
_component = "pdcluster"


class ContextFilter(logging.Filter):
    """Adds `component` and `request_id` (the record's own `extra`, else the current context's) to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = _component
        if not getattr(record, "request_id", ""):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, component, request_id, logger, message (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "component": getattr(record, "component", ""),
               "request_id": getattr(record, "request_id", ""), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(component)s %(name)s [%(request_id)s] %(message)s"


def configure(component: str, level: str = "INFO", fmt: str = "text") -> None:
    """Set up this process's root logger once: level, text or json, component name and request ids."""
    global _component
    _component = component
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_pdcluster", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._pdcluster = True  # type: ignore[attr-defined]
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level.upper())
