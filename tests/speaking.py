"""Tests that play several workers from one bus say each thing on the speaker's own subject
(subjects.SPOKEN), as the worker itself would; on an insecure test NATS nothing else stops them."""

from __future__ import annotations

from google.protobuf.message import Message

from services.common import subjects
from services.common.bus import Bus


async def speak(bus: Bus, suffix: str, msg: Message, kind: str = "") -> None:
    """Publishes `msg` as the worker it names (its `worker_id` or `engine_id`), of `kind` or the
    kind it names."""
    fields = msg.DESCRIPTOR.fields_by_name
    worker = next(getattr(msg, f) for f in ("worker_id", "engine_id") if f in fields)
    kind = kind or next((getattr(msg, f) for f in ("kind", "service") if f in fields), "")
    assert worker and kind, msg
    await bus.nc.publish(bus.subject(subjects.spoken(suffix, kind, worker)), msg.SerializeToString())
