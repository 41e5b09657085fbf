"""The scheduler's turns in flight, indexed by request and by engine (`Outstanding`): an engine's
load report reads that engine's turns alone, and the two maps never disagree."""

from __future__ import annotations

from services.scheduler.inflight import Outstanding


def test_turns_are_found_by_request_and_by_engine_and_forgotten_from_both() -> None:
    o = Outstanding()
    o.add("r1", "t1", "e0")
    o.add("r2", "t2", "e0")
    o.add("r3", "t3", "e1")
    assert len(o) == 3 and "r2" in o and o.get("r3") == "t3" and o.get("nope") is None
    assert o.on("e0") == {"r1": "t1", "r2": "t2"} and o.on("e1") == {"r3": "t3"} and o.on("e9") == {}
    assert o.pop("r1") == "t1" and o.pop("r1") is None and o.pop("r1", "gone") == "gone"
    assert o.on("e0") == {"r2": "t2"}
    o.pop("r2")
    assert o.on("e0") == {} and "e0" not in o._by_engine  # no empty entry per engine that ever served
    o.add("r3", "t3", "e2")  # the same request id again (never in practice): it moves, not doubles
    assert o.on("e1") == {} and o.on("e2") == {"r3": "t3"} and len(o) == 1
