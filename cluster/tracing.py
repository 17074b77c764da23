"""OpenTelemetry tracing of requests across the router and the workers, exported by OTLP when configured.

1. `configure(settings, component)` once per process (router, each worker): with `otlp_endpoint` set, spans go to
   that collector over OTLP/gRPC in batches; without it nothing is imported or created (no exporter, no tracer);
2. a request's trace context travels as a W3C `traceparent` string: from the client (HTTP header or gRPC metadata)
   into the router, in `PrefillRequest` / `DecodeRequest` over Ray to the workers;
3. `span(name, parent)` opens a child span of that context, and `traceparent_of(span)` is what the next hop gets.

NOTE: the KV transfer wire itself carries no trace context: the prefill worker's `kv_transfer` span (around its
sender) and the decode worker's `kv_take` span are children of the request's trace through the Ray messages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
TRACEPARENT = "traceparent"


@dataclass(frozen=True)
class TracingSettings:
    """Where spans go; the default (no endpoint) traces nothing."""

    otlp_endpoint: str = ""  # e.g. "http://127.0.0.1:4317"; "" = off
    service_name: str = "pdcluster"
    sample_ratio: float = 1.0  # of the traces that start here (a client's sampled flag is followed)
    insecure: bool = True  # plain gRPC to the collector (a sidecar or node-local agent)
    export_delay_ms: int = 1000  # batch export interval


_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer: Any = None


def enabled() -> bool:
    """Whether this process exports spans."""
    return _tracer is not None


def configure(settings: TracingSettings, component: str) -> None:
    """Export this process's spans to `settings.otlp_endpoint` (a no-op when it is empty)."""
    global _provider, _tracer
    if not settings.otlp_endpoint or _tracer is not None:
        return
    # NOTE: imported only when on: a cluster without tracing loads none of the SDK
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    # NOTE: a provider of our own, not the process-wide global: tests and embedders can turn it off again
    _provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name,
                                                         "service.instance.id": component}),
                               sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=settings.insecure)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_delay_ms))
    _tracer = _provider.get_tracer("pdcluster")
    log.info("tracing: exporting spans of %s to %s", component, settings.otlp_endpoint)


def shutdown() -> None:
    """Flush and stop exporting (at process exit, or a test's end)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def flush(timeout_s: float = 5.0) -> None:
    """Export every finished span now."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def _context(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent}) if traceparent else None


@contextlib.contextmanager
def span(name: str, parent: str = "", **attributes: Any) -> Iterator[Any]:
    """A span named `name`, child of the `parent` traceparent (a new trace without one); None when tracing is off."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, context=_context(parent), attributes=attributes or None,
                                       record_exception=True, set_status_on_exception=True) as s:
        yield s


def start(name: str, parent: str = "", **attributes: Any) -> Any:
    """A span to `end()` by hand (it may outlive the code that opened it); None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), attributes=attributes or None)


def end(s: Any) -> None:
    """End a span from `start` (nothing for None)."""
    if s is not None:
        s.end()


def traceparent_of(s: Any) -> str:
    """The W3C traceparent a child of `s` takes ("" for None)."""
    if s is None:
        return ""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(s))
    return carrier.get(TRACEPARENT, "")


def record(name: str, parent: str, start_ns: int, end_ns: int, **attributes: Any) -> str:
    """A finished span with the given wall-clock times (ns); its traceparent ("" when tracing is off)."""
    if _tracer is None:
        return ""
    s = _tracer.start_span(name, context=_context(parent), start_time=start_ns, attributes=attributes or None)
    s.end(end_time=max(start_ns, end_ns))
    return traceparent_of(s)


def wall_ns(monotonic_s: float, now_monotonic_s: float, now_ns: int) -> int:
    """The wall-clock time (ns) of a monotonic instant, given one pair of readings of both clocks."""
    return now_ns - int((now_monotonic_s - monotonic_s) * 1e9)
