"""An in-process OTLP/gRPC trace receiver: what Jaeger would receive, kept in memory for tests."""

from __future__ import annotations

from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    links: list[str]
    events: list[str]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[ReceivedSpan]):
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.sink.append(
                        ReceivedSpan(
                            name=s.name,
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={
                                a.key: a.value.string_value or a.value.int_value or a.value.double_value
                                for a in s.attributes
                            },
                            links=[link.trace_id.hex() for link in s.links],
                            events=[e.name for e in s.events],
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self.spans), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.stop(0)

    def by_trace(self) -> dict[str, list[ReceivedSpan]]:
        out: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for s in self.spans:
            out[s.trace_id].append(s)
        return out
