"""The OpenAI-compatible HTTP face of the router (aiohttp), served next to gRPC over the same `Router`.

Life of a request:
1. `/v1/*` needs `Authorization: Bearer <key>` when API keys are set (401 otherwise; a key is never logged);
2. the body is bounded before it costs the event loop (router/http_limits.py: 413 on a declared size over the
   limit, 408 on a slow body; a large body parsed off the loop, the size limits checked on the raw JSON; at most
   `max_connections` connections, idle or header-less ones closed after `keepalive_timeout_s`), a request past
   the router's admission limit is refused (429) before its body is read (reading, parsing and tokenizing count
   as in flight), and the JSON body is validated as a pydantic model (router/openai_models.py: unknown fields are
   ignored with one warning per name, unimplemented ones accepted at their neutral value only) and becomes a
   `PromptRequest` / `MessagesRequest`, checked by the same `RequestValidator` as gRPC (a 400 names the OpenAI
   parameter: `top_p`, `prompt`, `messages[1].role`); a client's `X-Request-Id` is the request id and comes back
   as a header; its `model` names the base model or a LoRA adapter (router/lora.py; unknown: 404);
3. `Router.stream` runs it within `router.request_timeout_s`; the answer is one JSON object or, with
   `stream: true`, server-sent events ending in `data: [DONE]` (router/openai_answer.py);
4. failures map to a Status through `router.errors.status_of`, to HTTP through `HTTP_OF`, with OpenAI's
   `{"error": {...}}` body; once a stream has started (status 200 sent) a failure is an SSE `error` event; a
   client that goes away aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from cluster.logs import REQUEST_ID
from engine.errors import InvalidRequestError
from router import http_limits as limits
from router.auth import UNAUTHENTICATED_MESSAGE, bearer_ok, check_exposure
from router.core import Router
from router.errors import ModelNotFound, Status
from router.openai_answer import ADMISSION_KEY, REQUEST_ID_HEADER, RID_KEY, answer
from router.openai_errors import ApiError, error_body
from router.openai_lora import ADMIN_PATHS, LoRAEndpoints, check_admin
from router.openai_models import ChatCompletionRequest, CompletionRequest, IgnoredFieldLog, ignored_fields, parse
from router.openai_params import chat_turns, prompt_of, sampling_fields, tool_request
from router.openai_tokenize import DetokenizeRequest, TokenizeRequest, detokenize, parse_model, tokenize
from router.validate import MessagesRequest, PromptRequest, RequestValidator, run_check

log = logging.getLogger(__name__)
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")  # counted in pdcluster_requests_total{api="http"}
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's; behind the API key like /v1/*


class OpenAIFront:
    """The handlers of the HTTP API over one Router."""

    def __init__(self, router: Router, model_name: str, api_keys: frozenset[str],
                 admin_keys: frozenset[str] = frozenset()) -> None:
        self.router, self.model_name = router, model_name
        self.validator = RequestValidator(router.info, router.settings.chat)
        # NOTE: as on gRPC, an admin key opens inference calls too; admin paths take only admin keys (if any)
        self._keys, self._admin = api_keys | admin_keys if api_keys else api_keys, admin_keys
        self._ignored = IgnoredFieldLog()
        # NOTE: its own threads: large bodies and tokenizing never queue ahead of the router's Redis lookups
        # (asyncio.to_thread's default pool), and at most two run at once
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="http-parse")

    @web.middleware
    async def guard(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """API keys on /v1/*, and every failure before a stream started as OpenAI's error JSON."""
        counted = request.path in INFERENCE_PATHS
        try:
            return await self._guarded(request, handler, counted)
        finally:
            admission = request.get(ADMISSION_KEY)
            if admission is not None:
                admission.release()

    async def _guarded(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                       counted: bool) -> web.StreamResponse:
        try:
            # NOTE: router.auth.bearer_ok compares in constant time; the header is never logged, not even a wrong one
            keyed = request.path.startswith("/v1/") or request.path in TOKENIZER_PATHS
            if request.path in ADMIN_PATHS:
                check_admin(request.headers.get("Authorization"), self._keys, self._admin)
            elif keyed and not bearer_ok(request.headers.get("Authorization"), self._keys):
                log.debug("refused %s %s from %s: missing or invalid API key", request.method, request.path,
                         request.remote)
                raise ApiError(Status.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, code="invalid_api_key")
            return await handler(request)
        except asyncio.CancelledError:  # the client went away
            if counted:
                self.router.metrics.request_done("http", Status.CANCELLED.name)
            raise
        except web.HTTPException as e:  # no route, wrong method, body too large
            status, body = e.status, {"error": {"message": e.reason, "type": "invalid_request_error",
                                                "param": None, "code": None}}
        except Exception as e:  # noqa: BLE001 - every failure becomes a status for this request only
            status, outcome, body = error_body(e)
            if counted:
                self.router.metrics.request_done("http", outcome.name)
        rid = request.get(RID_KEY)
        return web.json_response(body, status=status, headers={REQUEST_ID_HEADER: rid} if rid else None)

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 while a live worker can prefill and one can decode, else 503 (heartbeats in Redis)."""
        if self.router.healthy():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": "no live prefill-capable and decode-capable "
                                  "worker (heartbeats in Redis)"}, status=503)

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: 200 while this process serves or can recover by itself; 503 when only a restart helps."""
        reason = self.router.unrecoverable()
        if reason:
            return web.json_response({"status": "dead", "reason": reason}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        cards = self.router.adapters.cards(self.model_name, int(time.time()), self.router.info.max_model_len)
        return web.json_response({"object": "list", "data": cards})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, rid, _, lora = await self._open(request, CompletionRequest)
        req = PromptRequest(request_id=rid)
        prompt = prompt_of(body)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids = prompt
        req.sampling = sampling_fields(body, body.max_tokens)
        # NOTE: validation tokenizes: a long prompt or a grammar off the event loop, as in the gRPC service
        checked = await run_check(req.checks_on_loop(), self.executor, lambda: self.validator.prompt(req))
        checked.params.lora = lora
        return await answer(self.router, request, body, checked, f"cmpl-{checked.request_id}", chat=False,
                            model_name=self.model_name, tokenizer=self.validator.tokenizer)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, rid, size, lora = await self._open(request, ChatCompletionRequest)
        limit = body.max_completion_tokens  # NOTE: OpenAI's successor of max_tokens
        key = "max_tokens" if limit is None else "max_completion_tokens"
        limit = body.max_tokens if limit is None else limit
        turns = await limits.off_loop_if_large(size, self.executor, chat_turns, body.messages)
        req = MessagesRequest(request_id=rid, messages=turns, tools=tool_request(body))
        req.sampling = sampling_fields(body, limit, key)
        try:
            checked = await run_check(req.checks_on_loop(), self.executor, lambda: self.validator.chat(req))
        except InvalidRequestError as e:  # name the limit as the client spelled it
            if e.field != "sampling.max_tokens":
                raise
            raise InvalidRequestError(key, e.reason.removeprefix(f"{e.field}: "), e.request_id) from None
        if limit is None:  # NOTE: as OpenAI and vLLM: a chat without a limit may fill the context
            checked.params.max_tokens = self.router.info.max_model_len - len(checked.token_ids)
        checked.params.lora = lora
        return await answer(self.router, request, body, checked, f"chatcmpl-{checked.request_id}", chat=True,
                            model_name=self.model_name, tokenizer=self.validator.tokenizer)

    async def _open(self, request: web.Request, kind: type[Any]) -> tuple[Any, str, int, str | None]:
        """The body as a `kind` model, the request id (the client's X-Request-Id, if any), the body's size in
        bytes and the LoRA adapter `model` names; an unknown model is 404, a router at its admission limit 429
        (before the body is read)."""
        rid = request.headers.get(REQUEST_ID_HEADER, "")
        if rid:
            REQUEST_ID.set(rid)
            request[RID_KEY] = rid
        # NOTE: a slot before the body is read: bodies being read, parsed and tokenized count as in flight
        request[ADMISSION_KEY] = self.router.admit(rid)
        data = await limits.read_body(request)
        body = await limits.off_loop_if_large(len(data), self.executor, self._decode, data, kind)
        for name in ignored_fields(body):
            self.router.metrics.ignored_field(self._ignored.note(name))
        lora = self._adapter(body.model, rid)
        # NOTE: as vLLM: the header wins over the body's request_id; with neither, the validator makes one
        return body, rid or body.request_id or "", len(data), lora

    def _adapter(self, model: str | None, rid: str | None) -> str | None:
        try:  # NOTE: the LoRA adapter `model` names (None: the base model); an unknown model is 404, as in vLLM
            return self.router.adapters.resolve(model, self.model_name, rid or None)
        except ModelNotFound as e:
            raise ApiError(Status.NOT_FOUND, e.reason, "model", "model_not_found") from None

    def _decode(self, data: bytes, kind: type[Any]) -> Any:
        """JSON → size limits on the raw value → a `kind` model (on the executor for a large body)."""
        raw = limits.load_json(data, self.router.info.max_model_len)
        try:
            return parse(kind, raw)
        except RecursionError:  # NOTE: a value nested just within json's limit may still be too deep to validate
            raise InvalidRequestError("body", "is nested too deeply") from None

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt's or a conversation's token ids as the inference endpoints compute them."""
        return await self._tokenizer_call(request, TokenizeRequest, tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids."""
        return await self._tokenizer_call(request, DetokenizeRequest, detokenize)

    async def _tokenizer_call(self, request: web.Request, kind: type[Any], fn: Callable[..., Any]) -> web.Response:
        data = await limits.read_body(request)
        body = parse_model(kind, limits.load_json(data, self.router.info.max_model_len))
        self._adapter(body.model, rid=None)
        answer = await asyncio.get_running_loop().run_in_executor(self.executor, fn, self.validator, body)
        return web.json_response(answer)

def make_app(router: Router, *, model_name: str, api_keys: frozenset[str] = frozenset(),
             admin_keys: frozenset[str] = frozenset()) -> web.Application:
    """The HTTP API: /health (readiness), /live (liveness), /v1/models, /v1/completions, /v1/chat/completions,
    /tokenize, /detokenize, and the admin calls /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    front, lora = OpenAIFront(router, model_name, api_keys, admin_keys), LoRAEndpoints(router, model_name)
    app = web.Application(middlewares=[front.guard], client_max_size=limits.MAX_BODY_BYTES)

    async def stop_executor(app: web.Application) -> None:
        front.executor.shutdown(wait=False, cancel_futures=True)
    app.on_cleanup.append(stop_executor)
    app.router.add_get("/health", front.health)
    app.router.add_get("/live", front.live)
    app.router.add_get("/v1/models", front.models)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.chat)
    app.router.add_post("/tokenize", front.tokenize)
    app.router.add_post("/detokenize", front.detokenize)
    app.router.add_post(ADMIN_PATHS[0], lora.load)
    app.router.add_post(ADMIN_PATHS[1], lora.unload)
    return app


async def start_http(router: Router, *, host: str, port: int, model_name: str, api_keys: frozenset[str] = frozenset(),
                     admin_keys: frozenset[str] = frozenset(), ssl_context: ssl.SSLContext | None = None,
                     allow_unauthenticated: bool = False,
                     max_connections: int = limits.MAX_CONNECTIONS,
                     keepalive_timeout_s: float = limits.KEEPALIVE_TIMEOUT_S) -> tuple[web.AppRunner, int]:
    """A started HTTP server (HTTPS with `ssl_context`); returns its runner (`await runner.cleanup()`) and port.

    A non-loopback `host` needs `api_keys` or `allow_unauthenticated` (ExposureError otherwise). At most
    `max_connections` at once; one without a complete request for `keepalive_timeout_s` is closed.
    """
    check_exposure(host, api_keys, allow_unauthenticated, "http.host")
    # NOTE: handler_cancellation: a client that disconnects cancels its handler even while no token is being
    # written (a long prefill), so the request is aborted at once.
    router.start_health()
    runner = web.AppRunner(make_app(router, model_name=model_name, api_keys=api_keys, admin_keys=admin_keys),
                           handler_cancellation=True,
                           keepalive_timeout=keepalive_timeout_s)
    await runner.setup()
    limits.cap_connections(runner, max_connections)
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {e}") from e
    return runner, int(runner.addresses[0][1])
