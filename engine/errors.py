"""Exceptions raised by the engine; every one carries the request id (if any) and a reason.

NOTE: the gRPC layer maps these to status codes in one place: InvalidRequestError → INVALID_ARGUMENT,
CapacityError → RESOURCE_EXHAUSTED, everything else → INTERNAL.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        self.reason = reason
        self.request_id = request_id
        prefix = f"request {request_id!r}: " if request_id else ""
        super().__init__(prefix + reason)


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is malformed; `field` names the culprit."""

    def __init__(self, field: str, reason: str, request_id: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {reason}", request_id)


class ModelLoadError(EngineError, ValueError):
    """The model could not be found or read; `field` names the setting to fix (usually `model`)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        super().__init__(f"{field}: {reason}")


class CapacityError(EngineError):
    """The engine cannot take this request now (KV blocks or queue full); retrying later may succeed."""


class UnknownRequestError(EngineError, KeyError):
    """No request with this id is known to the engine."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return Exception.__str__(self)
