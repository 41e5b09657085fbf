"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers and gRPC metadata."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from services.common.logging import get_logger

_provider: TracerProvider | None = None
_file_exporter: OtlpJsonFileExporter | None = None

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node: Any) -> Any:
    """OTLP/JSON writes trace and span ids as hex, where protobuf's JSON mapping writes base64."""
    if isinstance(node, dict):
        return {
            k: base64.b64decode(v).hex() if k in _ID_FIELDS and isinstance(v, str) else _hex_ids(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


class OtlpJsonFileExporter(SpanExporter):
    """Writes finished spans as OTLP/JSON lines (one ExportTraceServiceRequest per line, the format
    of the OpenTelemetry Collector's `otlpjsonfile` receiver) to the file of the job running now:
    a run's trajectories can be read back without a collector (`libra trace`)."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._lock = threading.Lock()

    def set_path(self, path: Path | None) -> None:
        """A directory this process may not write (the tool sandbox's container has no shared
        volume) keeps the spans off file, logged once; they still go to OTLP when configured."""
        with self._lock:
            self._path = path
            if path is None:
                return
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                self._path = None
                get_logger(component="tracing").warning(
                    "trace_file_unwritable", path=str(path), error=str(err)
                )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        with self._lock:
            if self._path is None or not spans:
                return SpanExportResult.SUCCESS
            line = json.dumps(_hex_ids(MessageToDict(encode_spans(spans))), separators=(",", ":"))
            try:
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.set_path(None)


def set_trace_file(path: str | Path | None) -> None:
    """Sends this process's spans to `path` from now on (None: stop); what was recorded before is
    flushed to the previous file first."""
    if _file_exporter is None:
        return
    if _provider is not None:
        _provider.force_flush(timeout_millis=3000)
    _file_exporter.set_path(Path(path) if path is not None else None)


def otlp_exporter_options(endpoint: str, ca_file: str | None = None) -> dict[str, Any]:
    """An `https://` collector is reached over TLS (verified with `ca_file`, else the system's
    roots); `http://` or no scheme stays plaintext, as a collector on the same host or network."""
    if not endpoint.startswith("https://"):
        return {"endpoint": endpoint, "insecure": True}
    import grpc

    roots = Path(ca_file).read_bytes() if ca_file else None
    return {"endpoint": endpoint, "insecure": False, "credentials": grpc.ssl_channel_credentials(roots)}


def configure_tracing(
    service: str, *, run_id: str | None, worker_id: str, otlp_endpoint: str | None, ca_file: str | None = None
) -> None:
    """Installs a tracer provider: spans go to an OTLP endpoint when one is given, and to the job's
    trace file when the job names one (`set_trace_file`).

    A service that runs one job after another has no run id of its own; its spans carry the job's.
    """
    global _provider, _file_exporter
    attrs = {"service.name": f"libra-{service}", "service.instance.id": worker_id}
    if run_id:
        attrs["libra.run_id"] = run_id
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(**otlp_exporter_options(otlp_endpoint, ca_file))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    _file_exporter = OtlpJsonFileExporter()
    provider.add_span_processor(BatchSpanProcessor(_file_exporter, schedule_delay_millis=1000))
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
