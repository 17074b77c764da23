"""OpenAI's error answers: a refusal of the HTTP layer (`ApiError`) and any failure as an HTTP status and OpenAI's
`{"error": {...}}` object, through `router.errors.status_of` (the one mapping of failures to statuses)."""

from __future__ import annotations

import logging
from typing import Any

from engine.errors import InvalidRequestError
from router.errors import Status, status_of, unwrap
from router.openai_params import openai_param

log = logging.getLogger("router.openai_api")
HTTP_OF = {Status.INVALID_ARGUMENT: (400, "invalid_request_error"),  # status → HTTP status and OpenAI error type
           Status.UNAUTHENTICATED: (401, "authentication_error"),
           Status.PERMISSION_DENIED: (403, "permission_error"),
           Status.NOT_FOUND: (404, "invalid_request_error"),
           Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
           Status.UNAVAILABLE: (503, "service_unavailable"),
           Status.DEADLINE_EXCEEDED: (504, "server_error")}  # anything else: 500 server_error


class ApiError(Exception):
    """A refusal of the HTTP layer itself (a bad API key, an unknown model) with OpenAI's `param` and `code`."""

    def __init__(self, status: Status, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(exc: BaseException) -> tuple[int, Status, dict[str, Any]]:
    """The HTTP status, Status and OpenAI error object for `exc` (statuses from `status_of`, the one mapping)."""
    e = unwrap(exc)
    param = code = None
    if isinstance(e, ApiError):
        status, message, param, code = e.status, str(e), e.param, e.code
    else:
        status, message = status_of(e)
        if isinstance(e, InvalidRequestError):
            param = openai_param(e.field)
            message = f"{param}: {e.reason.removeprefix(f'{e.field}: ')}"
        elif status is Status.INTERNAL:
            log.error("request failed", exc_info=e)
    http_status, kind = HTTP_OF.get(status, (500, "server_error"))
    return http_status, status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
