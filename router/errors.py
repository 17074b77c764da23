"""Errors → gRPC status codes, in one place (and unwrapping what Ray wraps around a worker's exception)."""

from __future__ import annotations

import asyncio

import grpc

from engine.errors import CapacityError, EngineError, InvalidRequestError
from kv_transfer.state import TransferError


class Overloaded(CapacityError):
    """The router or the cluster cannot take the request now; retry later (RESOURCE_EXHAUSTED)."""


class WorkerFailed(EngineError):
    """A worker died or failed the request (UNAVAILABLE: the client may retry)."""


def unwrap(exc: BaseException) -> BaseException:
    """The worker's own exception inside Ray's RayTaskError (which also subclasses it), or `exc`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `exc`."""
    e = unwrap(exc)
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, TransferError | WorkerFailed):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the request did not finish in time"
    name = type(e).__name__
    if name in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError"):
        return grpc.StatusCode.UNAVAILABLE, f"a worker is unavailable: {e}"
    return grpc.StatusCode.INTERNAL, f"{name}: {e}"
