"""vLLM's LoRA admin endpoints on the HTTP front: `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Bodies as vLLM's (`{"lora_name": ..., "lora_path": ...}`; unload: `lora_name`). They change the cluster, so they
take the admin key (security.admin_api_keys_env; without admin keys, the API keys), as the gRPC method Scale does:
an inference key gets 403. The change reaches every worker or none (router/lora.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError
from router import http_limits as limits
from router.auth import FORBIDDEN_MESSAGE, UNAUTHENTICATED_MESSAGE, bearer_ok
from router.core import Router
from router.errors import Status
from router.openai_errors import ApiError

ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoRABody(BaseModel):
    """vLLM's LoadLoRAAdapterRequest."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRABody(BaseModel):
    """vLLM's UnloadLoRAAdapterRequest (its optional `lora_int_id` is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def check_admin(header: str | None, keys: frozenset[str], admin_keys: frozenset[str]) -> None:
    """ApiError 401 (no valid key) or 403 (an inference key) unless `header` carries an admin key."""
    if bearer_ok(header, admin_keys or keys):
        return
    if admin_keys and keys and bearer_ok(header, keys):
        raise ApiError(Status.PERMISSION_DENIED, FORBIDDEN_MESSAGE, code="permission_denied")
    raise ApiError(Status.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, code="invalid_api_key")


class LoRAEndpoints:
    """The two handlers over one Router; `base` is the served model's name (not an adapter name)."""

    def __init__(self, router: Router, base: str) -> None:
        self.router, self.base = router, base

    async def load(self, request: web.Request) -> web.Response:
        body = await _body(request, LoadLoRABody)
        await self.router.adapters.load(self.router.pools.by_name.values(), body.lora_name, body.lora_path,
                                        self.base)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await _body(request, UnloadLoRABody)
        await self.router.adapters.unload(self.router.pools.by_name.values(), body.lora_name)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _body(request: web.Request, kind: type[Any]) -> Any:
    data = await limits.read_body(request)
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise InvalidRequestError("body", f"is not valid JSON ({e})") from None
    try:
        return kind.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "body"
        raise InvalidRequestError(field, err["msg"]) from None
