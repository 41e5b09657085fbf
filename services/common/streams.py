"""A run's JetStream streams and durable consumers, created by the control identity only.

Services never create, change or delete streams or consumers (their NATS users may not:
services/common/credentials.py): `libra run` provisions a run's streams and consumers before it
starts the job (`provision`), each service binds to what it needs and waits until it is there, and
a completed run's streams are deleted after its report is written (`delete`). A service can thus
neither re-route a stream (a `republish` onto `traj.completed`), nor shrink one
(`max_msgs_per_subject`), nor read another service's durable consumer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig

from services.common import subjects

FEED_ACK_WAIT_S = 60.0
"""How long a delivery may go unacknowledged before JetStream redelivers it, unless the run says
otherwise (`job.feed_ack_wait_s`); the holders of long deliveries (the trainer's buffered groups)
mark them in progress every third of it."""


@dataclass(frozen=True)
class StreamSpec:
    what: str
    suffixes: tuple[str, ...]
    last_only: bool = False
    """Keeps one message per subject (current plan, facts): readers get it by subject (direct get)."""


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    suffix: str
    durable: str
    """Unique across streams: a service's NATS user may pull from and ack this name only."""


STREAMS = (
    StreamSpec("TRAJ", (subjects.TRAJ_COMPLETED,)),
    StreamSpec("GROUPS", (subjects.GROUP_OUTCOME,)),
    StreamSpec("PLAN", (subjects.PLAN,), last_only=True),
    StreamSpec(
        "FACTS", (subjects.FACTS_TRAINER, subjects.FACTS_SCHEDULER, subjects.FACTS_PLANNER), last_only=True
    ),
)
TRAINER_FEED = ConsumerSpec("TRAJ", subjects.TRAJ_COMPLETED, "trainer")
SCHEDULER_FEED = ConsumerSpec("GROUPS", subjects.GROUP_OUTCOME, "scheduler-feed")
CONSUMERS = (TRAINER_FEED, SCHEDULER_FEED)


def stream_config(run_id: str, spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=subjects.stream_name(run_id, spec.what),
        subjects=[subjects.subject(run_id, s) for s in spec.suffixes],
        retention=RetentionPolicy.LIMITS,
        max_msgs_per_subject=1 if spec.last_only else -1,
        duplicate_window=600.0,
        allow_direct=spec.last_only,
        deny_delete=not spec.last_only,  # what was trained and decided stays until the run is deleted
        deny_purge=not spec.last_only,
    )


def consumer_config(spec: ConsumerSpec, ack_wait_s: float) -> ConsumerConfig:
    return ConsumerConfig(
        name=spec.durable,
        durable_name=spec.durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_ack_pending=10_000,
    )


async def provision(js: JetStreamContext, run_id: str, ack_wait_s: float = FEED_ACK_WAIT_S) -> list[str]:
    """Creates (or brings up to date) the run's streams and consumers (their ack wait `ack_wait_s`,
    `job.feed_ack_wait_s`); returns the stream names. Idempotent: a resumed run keeps its streams,
    their messages and its consumers' positions (their ack wait becomes `ack_wait_s`)."""
    names = []
    for spec in STREAMS:
        cfg = stream_config(run_id, spec)
        try:
            await js.add_stream(cfg)
        except nats.js.errors.BadRequestError:  # exists (maybe from an older release): same settings
            await js.update_stream(cfg)
        assert cfg.name is not None
        names.append(cfg.name)
    for c in CONSUMERS:
        cfg_c = consumer_config(c, ack_wait_s)
        cfg_c.filter_subject = subjects.subject(run_id, c.suffix)
        stream = subjects.stream_name(run_id, c.stream)
        try:
            await js.add_consumer(stream, config=cfg_c)
        except nats.js.errors.BadRequestError:  # a setting that cannot change (an older release's): kept
            await js.consumer_info(stream, c.durable)
    return names


async def delete(js: JetStreamContext, run_id: str) -> list[str]:
    """Deletes the run's streams (and with them their consumers); returns those it deleted."""
    gone = []
    for spec in STREAMS:
        name = subjects.stream_name(run_id, spec.what)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            if await js.delete_stream(name):
                gone.append(name)
    return gone
