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
