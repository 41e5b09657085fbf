"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers and gRPC metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def configure_tracing(service: str, *, run_id: str | None, worker_id: str, otlp_endpoint: str | None) -> None:
    """Installs a tracer provider; spans leave the process only when an OTLP endpoint is given.

    A service that runs one job after another has no run id of its own; its spans carry the job's.
    """
    global _provider
    attrs = {"service.name": f"libra-{service}", "service.instance.id": worker_id}
    if run_id:
        attrs["libra.run_id"] = run_id
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=3000)
        _provider.shutdown()


def tracer(name: str = "libra") -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Returns `traceparent`/`tracestate` headers for the given (or current) context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def grpc_metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    return list(inject_headers(ctx).items())


def context_from_grpc(metadata: Any) -> otel_context.Context:
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
