"""Errors → a transport-neutral Status, in one place (and unwrapping what Ray wraps around a worker's exception).

`service.py` maps a Status to a gRPC status code and `openai_api.py` to an HTTP status; neither classifies
exceptions itself.
"""

from __future__ import annotations

import asyncio
import enum

from engine.errors import CapacityError, EngineError, InvalidRequestError
from kv_transfer.state import TransferError


class Status(enum.Enum):
    """How a request ended, for any front; the names are gRPC's status codes (metrics count by them)."""

    OK = "OK"
    CANCELLED = "CANCELLED"  # the client went away
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # bad input: retrying the same request fails again
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"  # an inference key on an admin call
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # overloaded: retry later
    UNAVAILABLE = "UNAVAILABLE"  # a worker failed: the client may retry
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"  # a bug: logged with its traceback


class Overloaded(CapacityError):
    """The router or the cluster cannot take the request now; retry later (RESOURCE_EXHAUSTED)."""


class DeadlineExceeded(EngineError):
    """The request's own deadline cannot be met, even on an idle cluster (DEADLINE_EXCEEDED: not a load signal)."""


class ClientStalled(EngineError):
    """The client read nothing for `router.client_stall_timeout_s` while its buffer was full (router/relay.py)."""


class ModelNotFound(EngineError):
    """A request's `model` is neither the base model nor a loaded LoRA adapter (NOT_FOUND, 404 as in vLLM)."""


class WorkerFailed(EngineError):
    """A worker died or failed the request (UNAVAILABLE: the client may retry)."""


# NOTE: the first matching class wins; Overloaded is a CapacityError.
STATUS_OF_ERROR: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], Status], ...] = (
    (InvalidRequestError, Status.INVALID_ARGUMENT),
    (CapacityError, Status.RESOURCE_EXHAUSTED),
    ((DeadlineExceeded, ClientStalled), Status.DEADLINE_EXCEEDED),
    ((TransferError, WorkerFailed), Status.UNAVAILABLE),
    (ModelNotFound, Status.NOT_FOUND),
)
RAY_UNAVAILABLE = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError")


def unwrap(exc: BaseException) -> BaseException:
    """The worker's own exception inside Ray's RayTaskError (which also subclasses it), or `exc`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def status_of(exc: BaseException) -> tuple[Status, str]:
    """The status and message a client gets for `exc`."""
    e = unwrap(exc)
    for kinds, status in STATUS_OF_ERROR:
        if isinstance(e, kinds):
            return status, str(e)
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return Status.DEADLINE_EXCEEDED, "the request did not finish in time"
    name = type(e).__name__
    if name in RAY_UNAVAILABLE:  # NOTE: by name: the router does not import ray
        return Status.UNAVAILABLE, f"a worker is unavailable: {e}"
    return Status.INTERNAL, f"{name}: {e}"
