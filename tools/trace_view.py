"""`libra trace TRAJECTORY_ID [--run RUN]`: where one trajectory spent its time, as a waterfall in the
terminal, read from the OTLP/JSON span files its run's services wrote (runs/<run>/traces/*.jsonl)
— no Jaeger needed. The trace holds the trajectory's queue waits, generation turns (and the
engine's own queue), tool calls, migrations, its reward and the training step that consumed it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BAR = 40


@dataclass
class SpanRow:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]] = field(default_factory=list)


def _value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    return json.dumps(v)


def _attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def read_spans(trace_dir: Path) -> list[SpanRow]:
    """Every span in the run's OTLP/JSON files (a torn last line, from a killed service, is skipped)."""
    rows: list[SpanRow] = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                request = json.loads(line)
            except json.JSONDecodeError:
                continue
            for rs in request.get("resourceSpans", []):
                service = str(_attrs(rs.get("resource", {}).get("attributes")).get("service.name", "?"))
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        rows.append(
                            SpanRow(
                                trace_id=s["traceId"],
                                span_id=s["spanId"],
                                parent_id=s.get("parentSpanId", ""),
                                name=s["name"],
                                service=service.removeprefix("libra-"),
                                start_ns=int(s["startTimeUnixNano"]),
                                end_ns=int(s["endTimeUnixNano"]),
                                attributes=_attrs(s.get("attributes")),
                                events=[(e["name"], int(e["timeUnixNano"])) for e in s.get("events", [])],
                            )
                        )
    return rows


class TraceNotFound(LookupError):
    pass


def trajectory_trace(rows: list[SpanRow], trajectory_id: str) -> list[SpanRow]:
    """The spans of the trajectory's trace, parents before children, siblings by start time."""
    roots = [
        r for r in rows if r.name == "trajectory" and r.attributes.get("libra.trajectory_id") == trajectory_id
    ]
    if not roots:
        known = sorted({str(r.attributes["libra.trajectory_id"]) for r in rows if r.name == "trajectory"})
        hint = (
            f"; trajectories in this run: {', '.join(known[:5])}{' …' if len(known) > 5 else ''}"
            if known
            else ""
        )
        raise TraceNotFound(f"no trace of trajectory {trajectory_id!r}{hint}")
    trace_id = roots[0].trace_id
    spans = {r.span_id: r for r in rows if r.trace_id == trace_id}
    children: dict[str, list[SpanRow]] = {}
    for r in list(spans.values()):
        parent = r.parent_id if r.parent_id in spans else ""
        children.setdefault(parent, []).append(r)
        for name, at in r.events:  # an event (e.g. a migration) is a point among the span's children
            point = SpanRow(r.trace_id, "", r.span_id, name, r.service, at, at, {"_event": True})
            children.setdefault(r.span_id, []).append(point)
    ordered: list[SpanRow] = []

    def walk(parent: str, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda x: (x.start_ns, x.name)):
            r.attributes["_depth"] = depth
            ordered.append(r)
            if r.span_id:
                walk(r.span_id, depth + 1)

    walk("", 0)
    return ordered


def _detail(r: SpanRow) -> str:
    keys = (
        "libra.turn",
        "libra.bucket",
        "libra.engine_id",
        "libra.tool",
        "libra.tool_status",
        "libra.reward",
        "libra.reward_failure",
        "libra.train_step",
        "libra.finish",
    )
    return " ".join(f"{k.removeprefix('libra.')}={r.attributes[k]}" for k in keys if k in r.attributes)


def waterfall(spans: list[SpanRow]) -> str:
    t0 = min(r.start_ns for r in spans)
    t1 = max(r.end_ns for r in spans)
    total = max(t1 - t0, 1)
    root = spans[0]
    lines = [
        f"trajectory {root.attributes.get('libra.trajectory_id')}  trace {root.trace_id}  "
        f"{(root.end_ns - root.start_ns) / 1e9:.3f} s in flight, {total / 1e9:.3f} s to its training step",
        f"{'start':>9} {'duration':>9}  {'span':<28} {'service':<15} {'':<{BAR}}  detail",
    ]
    for r in spans:
        name = "  " * int(r.attributes.get("_depth", 0)) + r.name
        if r.attributes.get("_event"):
            mark = " " * min(BAR - 1, int((r.start_ns - t0) / total * BAR)) + "▲"
            lines.append(f"{(r.start_ns - t0) / 1e9:>8.3f}s {'event':>9}  {name:<28} {'':<15} {mark:<{BAR}}")
            continue
        a = int((r.start_ns - t0) / total * BAR)
        b = max(a + 1, int(round((r.end_ns - t0) / total * BAR)))
        bar = " " * a + "█" * (b - a)
        lines.append(
            f"{(r.start_ns - t0) / 1e9:>8.3f}s {(r.end_ns - r.start_ns) / 1e9:>8.3f}s  {name:<28} "
            f"{r.service:<15} {bar:<{BAR}}  {_detail(r)}"
        )
    return "\n".join(lines)


def slowest(rows: list[SpanRow], n: int = 10) -> str:
    trajs = sorted((r for r in rows if r.name == "trajectory"), key=lambda r: r.start_ns - r.end_ns)
    lines = [f"{len(trajs)} trajectories traced; the slowest:", f"{'seconds':>9}  trajectory"]
    lines += [
        f"{(r.end_ns - r.start_ns) / 1e9:>9.3f}  {r.attributes.get('libra.trajectory_id')}" for r in trajs[:n]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.run_dirs import add_output_dir, find_run

    p = argparse.ArgumentParser(prog="libra trace", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trajectory_id", nargs="?", help="omitted: list the run's slowest trajectories")
    p.add_argument("--run", default="latest", help="run id under --output-dir (default: the last run)")
    add_output_dir(p)
    args = p.parse_args(argv)

    run_dir, looked = find_run(args.run, args.runs_dir, needs="traces")
    if run_dir is None:
        where = ", ".join(str(d / "traces") for d in looked)
        print(f"no traces for run {args.run!r} in {where} (runs started by `libra run` write them there)")
        return 2
    trace_dir = run_dir / "traces"
    rows = read_spans(trace_dir)
    if args.trajectory_id is None:
        print(slowest(rows))
        return 0
    try:
        spans = trajectory_trace(rows, args.trajectory_id)
    except TraceNotFound as e:
        print(e)
        return 1
    print(waterfall(spans))
    return 0
