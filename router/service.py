"""The gRPC face of the router: `pdcluster.v1.Inference` over grpc.aio, plus health and reflection.

Each RPC validates (INVALID_ARGUMENT names the field), hands the request to `Router.stream`, and maps any
failure to a status code through `router.errors.status_of`; one failing request never affects another.
Protobuf stays here: the router's chunks and statuses are plain dataclasses, converted on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.logs import REQUEST_ID
from engine.logprobs import TokenLogprobs
from router.admission import Admission
from router.auth import ApiKeyInterceptor, check_exposure
from router.core import Router
from router.errors import ClientStalled, Status, status_of
from router.fanout import fan_out
from router.grpc_requests import ProtoValidator, tolerant_parser
from router.results import Chunk, ClusterStatus, fields_of
from router.scaling import PoolScaler
from router.tool_calls import ToolCall
from router.tool_stream import merge_calls
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc
from router.validate import Checked, RequestValidator, run_check

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
GRPC_CODE = {s: grpc.StatusCode[s.name] for s in Status}  # NOTE: a Status is named after its gRPC code
MAX_MESSAGE_BYTES = 16 << 20  # a request: the longest prompt (1 Mi characters) with room to spare
MIN_CONCURRENT_RPCS = 256  # calls at once at least; else 4 x router.max_inflight


def chunk_pb(chunk: Chunk) -> pb.GenerateChunk:
    """A chunk on the wire (usage and timeline only on the last one)."""
    out = pb.GenerateChunk(request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text,
                           finish_reason=chunk.finish_reason, index=chunk.index)
    # NOTE: only the fields a chunk has: most chunks are one token and its text (this runs for every one)
    if chunk.logprobs:
        out.logprobs.extend(logprobs_pb(chunk.logprobs))
    if chunk.prompt_logprobs:
        out.prompt_logprobs.extend(logprobs_pb([e for e in chunk.prompt_logprobs if e is not None]))
    if chunk.tool_calls:
        out.tool_calls.extend(pb.ToolCall(index=p.index, id=p.id, name=p.name, arguments=p.arguments)
                              for p in chunk.tool_calls)
    if chunk.usage is not None:
        out.usage.CopyFrom(pb.Usage(**fields_of(chunk.usage)))
    if chunk.timeline is not None:
        out.timeline.CopyFrom(pb.Timeline(**fields_of(chunk.timeline)))
    return out


def logprobs_pb(entries: Sequence[TokenLogprobs]) -> list[pb.TokenLogprob]:
    """Logprobs on the wire."""
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank or 0,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top]) for e in entries]


def status_pb(status: ClusterStatus) -> pb.ClusterStatus:
    """A cluster status on the wire."""
    fields = {f.name: getattr(status, f.name) for f in dataclasses.fields(status) if f.name != "workers"}
    return pb.ClusterStatus(**fields, workers=[pb.WorkerStatus(**dataclasses.asdict(w)) for w in status.workers])


class InferenceService(pb_grpc.InferenceServicer):
    """Generate / GenerateStream / Chat / ChatStream / GetClusterStatus, and the admin method Scale."""

    def __init__(self, router: Router, scaler: PoolScaler | None = None) -> None:
        self.router = router
        self.scaler = scaler
        self.validator = ProtoValidator(RequestValidator(router.info, router.settings.chat),
                                        lambda model, rid: router.adapters.resolve(model, router.settings.model, rid))
        self.tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-tokenize")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        return await self._unary(request, lambda: self.validator.generate(request), context)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._write(self._stream(request, lambda: self.validator.generate(request), context), context)

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        return await self._unary(request, lambda: self.validator.chat(request), context)

    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> None:
        await self._write(self._stream(request, lambda: self.validator.chat(request), context), context)

    @staticmethod
    async def _write(chunks: AsyncGenerator[Chunk, None], context: grpc.aio.ServicerContext) -> None:
        """A streaming call's chunks, each written to its client: a coroutine handler, never a generator one.

        NOTE: a client that goes away ends the handler wherever it waits, most often in a write (which fails, and
        then gRPC cancels the task as well). A handler that is an async generator is left suspended there,
        unclosed: its run (the worker's stream and lease, the KV blocks, the admission slot) lived on until a
        garbage collection or the client-stall cut. Here the write is ours, so `chunks` is closed at once.
        """
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await context.write(chunk_pb(chunk))

    async def GetClusterStatus(self, request: pb.ClusterStatusRequest,
                               context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        return status_pb(await self.router.status())

    async def Scale(self, request: pb.ScaleRequest, context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        if self.scaler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router cannot resize its pools")
        assert self.scaler is not None
        try:
            result = await self.scaler.scale(request.prefill if request.HasField("prefill") else None,
                                             request.decode if request.HasField("decode") else None)
        except Exception as e:  # noqa: BLE001 - mapped to a status in one place
            status, message = status_of(e)
            if status is Status.INTERNAL:
                log.exception("scale failed")
            await context.abort(GRPC_CODE[status], message)
        return pb.ScaleResponse(prefill=result.prefill, decode=result.decode, added=result.added,
                                removed=result.removed)

    async def _unary(self, request: object, check: Callable[[], Checked],
                     context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        resp = pb.GenerateResponse()
        choices: dict[int, pb.Choice] = {}
        calls: dict[int, list[ToolCall]] = {}  # a chat with tools: each choice's whole calls
        completion_tokens = 0
        async with contextlib.aclosing(self._stream(request, check, context)) as chunks:
            async for chunk in chunks:
                c = choices.setdefault(chunk.index, pb.Choice(index=chunk.index))
                c.token_ids.extend(chunk.token_ids)
                c.text += chunk.text
                c.logprobs.extend(logprobs_pb(chunk.logprobs))
                merge_calls(calls.setdefault(chunk.index, []), chunk.tool_calls)
                if chunk.prompt_logprobs is not None:
                    resp.prompt_logprobs.extend(logprobs_pb([e for e in chunk.prompt_logprobs if e is not None]))
                if chunk.finish_reason:
                    c.finish_reason = chunk.finish_reason
                    last = chunk_pb(chunk)
                    completion_tokens += last.usage.completion_tokens
                    if chunk.index == 0:
                        resp.request_id = chunk.request_id
                        resp.usage.CopyFrom(last.usage)
                        resp.timeline.CopyFrom(last.timeline)
        for i, whole in calls.items():
            choices[i].tool_calls.extend(pb.ToolCall(index=k, id=t.id, name=t.name, arguments=t.arguments)
                                         for k, t in enumerate(whole))
        first = choices.get(0, pb.Choice())
        resp.tool_calls.extend(first.tool_calls)
        resp.token_ids.extend(first.token_ids)
        resp.text, resp.finish_reason = first.text, first.finish_reason
        resp.logprobs.extend(first.logprobs)
        resp.usage.completion_tokens = completion_tokens
        if len(choices) > 1:
            resp.choices.extend(choices[i] for i in sorted(choices))
        return resp

    async def _stream(self, request: object, check: Callable[[], Checked],
                      context: grpc.aio.ServicerContext) -> AsyncGenerator[Chunk, None]:
        arrived = time.monotonic()
        admission: Admission | None = None
        try:
            # NOTE: the size limits first (counts only), then a slot, then the tokenizing: a flood of huge prompts
            # is refused before it costs anything, and what is tokenized is within the admission limit
            self.validator.precheck(request)  # type: ignore[arg-type]
            admission = self.router.admit(getattr(request, "request_id", ""))
            # NOTE: a long prompt, a grammar or tools off the event loop (they would stall every stream), on threads
            # of its own: never queued ahead of the router's Redis lookups (asyncio.to_thread's default pool)
            req = await run_check(self.validator.on_loop(request), self.tokenizing, check)  # type: ignore[arg-type]
            REQUEST_ID.set(req.request_id)  # NOTE: set in the handler's task: the tasks it starts inherit it
            # NOTE: the tighter of router.request_timeout_s and the client's own gRPC deadline
            budget = min(self.router.settings.request_timeout_s, context.time_remaining() or float("inf"))
            # NOTE: aclosing: a generator left early is closed now (its finally aborts the request), not at GC
            # NOTE: the client's W3C trace context (gRPC metadata keys are lower case)
            traceparent = dict(context.invocation_metadata() or ()).get("traceparent", "")
            runs = fan_out(lambda c: self.router.stream_within(c, arrived, budget, str(traceparent), admission,
                                                                 lambda e: self._cut(e, context)), req)
            async with contextlib.aclosing(runs) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or its deadline passed)
            self.router.metrics.request_done("grpc", Status.CANCELLED.name)
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status for this request only
            status, message = status_of(e)
            self.router.metrics.request_done("grpc", status.name)
            if status is Status.INTERNAL:
                log.exception("request failed")
            await context.abort(GRPC_CODE[status], message)
        finally:
            if admission is not None:
                admission.release()
        self.router.metrics.request_done("grpc", Status.OK.name)


    async def _cut(self, stalled: ClientStalled, context: grpc.aio.ServicerContext) -> None:
        """End a call whose client stopped reading (router/relay.py) with its status, now.

        NOTE: the handler's task waits in a write the client's full window holds; an abort from another task still
        ends the call at once (gRPC sends the status and resets the stream), so the client hears why, and the
        call's slot is free before the client's own deadline.
        """
        status, message = status_of(stalled)
        self.router.metrics.request_done("grpc", status.name)
        with contextlib.suppress(grpc.aio.AbortError):
            await context.abort(GRPC_CODE[status], message)


def add_inference_service(service: InferenceService, server: grpc.aio.Server) -> None:
    """Register the Inference RPCs like the generated code does, but with deserializers that never raise."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(getattr(service, m.name), request_deserializer=tolerant_parser(
            getattr(pb, m.input_type.name)), response_serializer=getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start_server(router: Router, host: str = "127.0.0.1", port: int = 0, *,
                       api_keys: frozenset[str] = frozenset(), credentials: grpc.ServerCredentials | None = None,
                       allow_unauthenticated: bool = False,
                       scaler: PoolScaler | None = None,
                       admin_keys: frozenset[str] = frozenset()) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with Inference, grpc.health.v1 and server reflection; returns it and its port.

    Health: the overall service ("") and Inference are SERVING while a live worker can prefill and one can decode
    (the router's heartbeat view), NOT_SERVING otherwise.

    With `api_keys`, Inference and reflection calls need `authorization: Bearer <key>`; with `credentials`, the
    port speaks TLS. A non-loopback `host` needs `api_keys` or `allow_unauthenticated` (ExposureError otherwise).
    With `scaler`, the admin method Scale resizes the pools (and the scaler follows lost workers from now on);
    with `admin_keys`, only those open it (router/auth.py).
    """
    check_exposure(host, api_keys, allow_unauthenticated, "router.host")
    # NOTE: bounded calls: past the limit gRPC answers RESOURCE_EXHAUSTED before the handler runs (the admission
    # limit refuses requests sooner; health, status and refused calls need the room above it)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                             interceptors=[ApiKeyInterceptor(api_keys, admin_keys)] if api_keys or admin_keys
                             else None,
                             maximum_concurrent_rpcs=max(MIN_CONCURRENT_RPCS, 4 * router.max_inflight))
    add_inference_service(InferenceService(router, scaler), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (router.host / router.port)")
    await server.start()

    def on_health(serving: bool) -> None:
        """grpc.health.v1 follows the router's health: NOT_SERVING while no live worker pair is left."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(health_servicer.set(name, status))

    on_health(router.healthy())
    router.health_listeners.append(on_health)
    router.start_health()
    if scaler is not None:
        scaler.start_watch()
    return server, bound
