"""What a service owns that a job's report reads, published by that service.

Each owner publishes its facts (the trainer its commit record, the scheduler its ledger's
accounting and evaluation rounds, the planner its plan and role history) on its own subject of the
run's FACTS stream, which keeps only the last message per subject. The operator's `libra run`
reads them there: it needs no access to the services' Redis keys, only the owner may publish on
its subject (services/common/credentials.py), and a report written after a service stopped still
finds its last word.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from google.protobuf.message import Message

from services.common import subjects
from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.tasks import retry_pause

M = TypeVar("M", bound=Message)

STREAM = "FACTS"
SUBJECTS = [subjects.FACTS_TRAINER, subjects.FACTS_SCHEDULER, subjects.FACTS_PLANNER]


class FactsOut:
    """One service's facts on their way out: `update` sets the newest; a background task publishes
    it until JetStream has it (newer facts replace one still waiting, and a NATS outage only delays
    them)."""

    def __init__(self, bus: Bus, suffix: str):
        if suffix not in SUBJECTS:
            raise ValueError(f"{suffix!r} is not a facts subject ({', '.join(SUBJECTS)})")
        self.bus, self.suffix = bus, suffix
        self.log = get_logger(component="facts")
        self._latest: Message | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        await self.bus.bind_stream(STREAM)
        self.bus.spawn(self._run())

    def update(self, msg: Message) -> None:
        self._latest = msg
        self._wake.set()

    async def _run(self) -> None:
        attempt = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            msg = self._latest
            if msg is None:
                continue
            try:
                await self.bus.js.publish(self.bus.subject(self.suffix), msg.SerializeToString(), timeout=10)
            except Exception as err:  # JetStream away: the newest facts go out once it is back
                attempt += 1
                self.log.warning("facts_publish_failed", subject=self.suffix, error=str(err), attempt=attempt)
                await retry_pause(attempt)
                self._wake.set()
                continue
            attempt = 0
            if self._latest is msg:
                self._latest = None


async def read_facts(bus: Bus, suffix: str, msg_type: type[M]) -> M | None:
    """The last facts published on `suffix` (None when there are none yet)."""
    return await bus.last_message(suffix, STREAM, msg_type)
