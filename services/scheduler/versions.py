"""The newest weight version the trainer has made, as the scheduler knows it: from the trainer's
`weights.updated`, floored by its commit record (the trainer's facts) every few seconds and when a
turn result claims a newer version. It bounds admission (the staleness bound), the versions a turn
result may claim, and which groups can still be trained."""

from __future__ import annotations

import time
from typing import Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.facts import read_facts

CHECK_S = 2.0
"""How often the scheduler's tick reads the trainer's commit record."""


class TrainedVersion:
    def __init__(self, bus: Bus, log: Any):
        self.bus, self.log = bus, log
        self.version = 0
        self.checked = float("-inf")

    async def on_weights(self, msg: ev.WeightsUpdated, _: Envelope) -> None:
        if msg.version > self.version:
            self.version = msg.version
            self.log.info("policy_version", version=msg.version)

    async def committed(self) -> int:
        """The version of the trainer's last committed step, as its facts say (0: none yet)."""
        facts = await read_facts(self.bus, subjects.FACTS_TRAINER, ev.TrainerFacts)
        return facts.version if facts is not None else 0

    async def newest(self, claimed: int) -> int:
        """The newest version the trainer has made, read again from its facts when a turn result
        claims a newer one (at most twice a second, however many such results come)."""
        if claimed > self.version + 1 and time.monotonic() - self.checked > 0.5:
            await self.check()
        return self.version

    async def tick(self) -> None:
        """Reads the commit record when `CHECK_S` have passed since the last read."""
        if time.monotonic() - self.checked > CHECK_S:
            await self.check()

    async def check(self) -> None:
        """The trainer's commit record is the floor of the trained version: a `weights.updated`
        missed while this scheduler was down (core NATS keeps none) costs a few seconds, not the job."""
        self.checked = time.monotonic()
        try:
            version = await self.committed()
        except Exception as err:
            self.log.warning("commit_record_unavailable", error=str(err))
            return
        if version > self.version:
            self.version = version
            self.log.info("policy_version", version=version, source="commit_record")
