"""The span file exporter writes OTLP/JSON lines that `libra trace` reads back into a waterfall."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from services.common.tracing import OtlpJsonFileExporter
from tools.trace_view import TraceNotFound, read_spans, trajectory_trace, waterfall


def _write_trace(path: Path) -> None:
    exporter = OtlpJsonFileExporter()
    exporter.set_path(path)
    provider = TracerProvider(resource=Resource.create({"service.name": "libra-scheduler"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = provider.get_tracer("test")
    root = t.start_span("trajectory", attributes={"libra.trajectory_id": "t-1"}, start_time=1_000_000_000)
    ctx = trace.set_span_in_context(root)
    t.start_span("turn.queued", context=ctx, start_time=1_100_000_000).end(end_time=1_600_000_000)
    gen = t.start_span("turn.generate", context=ctx, start_time=1_600_000_000, attributes={"libra.turn": 0})
    gen.end(end_time=3_000_000_000)
    root.add_event("migrated", timestamp=3_000_000_000)
    root.end(end_time=4_000_000_000)
    t.start_span("train.step", context=ctx, start_time=5_000_000_000, attributes={"libra.train_step": 2}).end(
        end_time=6_000_000_000
    )
    t.start_span("trajectory", attributes={"libra.trajectory_id": "t-2"}).end()
    provider.shutdown()


def test_spans_round_trip_through_otlp_json(tmp_path: Path) -> None:
    _write_trace(tmp_path / "scheduler.jsonl")
    (tmp_path / "scheduler.jsonl").open("a").write('{"resourceSpans": [torn')  # a killed writer
    rows = read_spans(tmp_path)
    assert len(rows) == 5 and all(len(r.trace_id) == 32 and len(r.span_id) == 16 for r in rows)
    spans = trajectory_trace(rows, "t-1")
    assert [r.name for r in spans] == ["trajectory", "turn.queued", "turn.generate", "migrated", "train.step"]
    assert spans[1].parent_id == spans[0].span_id and spans[0].service == "scheduler"
    text = waterfall(spans)
    assert "5.000 s to its training step" in text and "3.000 s in flight" in text
    assert "   0.100s    0.500s    turn.queued" in text
    assert "   2.000s     event    migrated" in text and "train_step=2" in text and "turn=0" in text
    with pytest.raises(TraceNotFound, match="trajectories in this run: t-1, t-2"):
        trajectory_trace(rows, "t-3")
