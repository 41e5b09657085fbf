"""A job's trace file where the process may not write (the sandbox container has no shared volume)
costs the file, never the job."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

from services.common.tracing import OtlpJsonFileExporter


def test_an_unwritable_trace_directory_keeps_spans_off_file(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the run's directory would go")
    exporter = OtlpJsonFileExporter()
    exporter.set_path(blocker / "r1" / "traces" / "tool-sandbox.jsonl")  # no raise
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("turn"):
        pass
    good = tmp_path / "ok" / "w.jsonl"
    exporter.set_path(good)
    with provider.get_tracer("t").start_as_current_span("turn"):
        pass
    assert good.read_text().count("\n") == 1
    assert exporter.export([]) == SpanExportResult.SUCCESS


def test_an_https_collector_is_reached_over_tls_and_http_stays_plaintext(tmp_path: Path) -> None:
    from services.common.tracing import otlp_exporter_options
    from tests.tls_certs import make_certs

    assert otlp_exporter_options("http://jaeger:4317") == {"endpoint": "http://jaeger:4317", "insecure": True}
    secure = otlp_exporter_options("https://collector.observability.svc:4317", str(make_certs(tmp_path).ca))
    assert secure["insecure"] is False and secure["credentials"] is not None
    assert otlp_exporter_options("https://collector:4317")["insecure"] is False  # the system's roots
