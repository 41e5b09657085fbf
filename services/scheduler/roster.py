"""The plan's serving engines as the scheduler routes to them: each one's lease, those taken out of
routing for their invalid results, and what becomes of the turns an engine had when it leaves the
plan, restarts, moves out of rollout, loses a turn on the way, or answers one with garbage. Turns
themselves are the transport's (`inflight.py`); this changes them only through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from services.common.contracts import ev
from services.common.logging import get_logger
from services.policy.quarantine import Quarantine
from services.scheduler.config import SchedulerSettings
from services.scheduler.inflight import InFlight, Live


class Roster:
    def __init__(self, inflight: InFlight, settings: SchedulerSettings):
        self.inflight = inflight
        self.dispatch = inflight.dispatch
        self.settings = settings
        self.log = get_logger(component="scheduler")
        self.tokens: dict[str, int] = {}
        """Each engine's fencing token in the current plan (a new one: it restarted)."""
        self.quarantine = Quarantine(settings.max_invalid_results)
        """Engines out of routing for their invalid turn results (services/scheduler/driver.py
        checks each result)."""
        self._plan_engines: dict[str, ev.Assignment] = {}
        self._plan_moved: Mapping[str, int] = {}

    async def set_engines(
        self, current: dict[str, ev.Assignment], moved: Mapping[str, int] | None = None
    ) -> None:
        """The plan's serving engines. An engine that left the plan, or came back under a new
        lease (it restarted), has lost whatever turns it was running: they are re-sent at once.
        One still in the plan under the same lease but out of rollout (`moved`: worker id ->
        fencing token of those drained, parked, in training) hands its turns back itself, running ones with the tokens they generated:
        those wait for that, and are re-sent if they are not back within `handback_wait_s`."""
        plan_engines, current = (
            current,
            {wid: a for wid, a in current.items() if self.quarantine.serves(wid, a.fencing_token)},
        )
        gone = [
            wid
            for wid in self.dispatch.engines
            if wid not in current or current[wid].fencing_token != self.tokens.get(wid)
        ]
        moved = moved or {}
        handing_back = {wid for wid in gone if wid in moved and moved[wid] == self.tokens.get(wid)}
        self._plan_engines, self._plan_moved = plan_engines, moved
        self.dispatch.forget(gone)  # a restarted engine comes back with no turns in flight
        self.dispatch.set_engines({wid: a.bucket for wid, a in current.items()})
        self.tokens = {wid: a.fencing_token for wid, a in current.items()}
        self.log.info(
            "engines_updated",
            engines={wid: e.bucket for wid, e in sorted(self.dispatch.engines.items())},
        )
        waiting: list[tuple[str, str]] = []
        for live in self.inflight.all():
            if live.engine_id in gone and live.request_id in self.inflight.requests and live.pending_action:
                if live.engine_id in handing_back:
                    waiting.append((live.trajectory_id, live.request_id))
                    continue
                self.inflight.requests.pop(live.request_id, None)
                self.log.info("turn_redispatched", trajectory_id=live.trajectory_id, engine_id=live.engine_id)
                await self.inflight.send_turn(live, live.pending_action)
        if waiting:
            self.inflight.bus.spawn(self._unless_handed_back(waiting))
        await self.inflight.drain_all()

    async def _unless_handed_back(self, turns: list[tuple[str, str]]) -> None:
        """Re-sends the turns an engine moved out of rollout has not handed back in time."""
        await asyncio.sleep(self.settings.handback_wait_s)
        for traj_id, request_id in turns:
            live = self.inflight.get(traj_id)
            if (
                self.inflight.requests.get(request_id) != traj_id
                or live is None
                or live.pending_action is None
            ):
                continue  # handed back (or finished) meanwhile
            self.inflight.requests.pop(request_id, None)
            self.log.warning("turn_not_handed_back", trajectory_id=traj_id, engine_id=live.engine_id)
            await self.inflight.send_turn(live, live.pending_action)

    async def engine_load(self, load: ev.EngineLoad) -> None:
        """A turn the engine does not hold, two reports in a row, was lost on the way there or back
        (a NATS restart, a dropped message): re-sent now rather than after the turn timeout. Only
        once the engine has read past it (`last_seq`), and once `answered_grace_s` has passed since
        the engine first said it answered it (`answered_ids`): an engine too busy to read its
        requests, or a scheduler too busy to read the results, for a while has lost nothing."""
        if load.engine_id not in self.dispatch.engines:
            return
        self.dispatch.set_capacity(load.engine_id, load.capacity_seqs, load.free_kv_tokens)
        held = set(load.request_ids)
        answered = set(load.answered_ids)
        now = time.monotonic()
        for request_id, traj_id in list(self.inflight.requests.on(load.engine_id).items()):
            live = self.inflight.get(traj_id)
            if live is None or live.request_id != request_id or request_id not in self.inflight.requests:
                continue  # (a turn re-sent or ended while an earlier one was handled)
            unread = load.last_seq < live.seq
            if live.request_id in held or unread or now - live.sent_at < self.settings.lost_turn_grace_s:
                live.missing = 0
                continue
            if live.request_id in answered:  # its result is on the way, unless NATS dropped it
                live.answered_at = live.answered_at or now
                if now - live.answered_at < self.settings.answered_grace_s:
                    live.missing = 0
                    continue
            live.missing += 1
            if live.missing >= 2 and live.pending_action is not None:
                self.inflight.forget_turn(live)
                live.missing = 0
                live.lost += 1
                self.log.warning(
                    "turn_lost", trajectory_id=live.trajectory_id, engine_id=load.engine_id, times=live.lost
                )
                if live.lost == 1:  # a dropped message: re-sent at once, no retry spent
                    await self.inflight.send_turn(live, live.pending_action)
                else:  # lost again: an engine may never take it, so each further loss spends a retry
                    live.last_error = (
                        f"{load.engine_id}: turns lost {live.lost} times (not in its load reports)"
                    )
                    await self.inflight.retry_or_fail(live)

    def valid_result(self, engine_id: str) -> None:
        self.quarantine.valid(engine_id)

    def count_invalid(self, engine_id: str, reason: str) -> bool:
        """Counts an invalid result from `engine_id`; True when it makes the engine one to take
        out of routing (`services/policy/quarantine.py`)."""
        q = self.quarantine
        due = q.invalid_result(
            engine_id,
            self.tokens.get(engine_id),
            len(self.dispatch.engines) > (engine_id in self.dispatch.engines),
        )
        self.log.warning(
            "turn_result_invalid",
            engine_id=engine_id,
            reason=reason[:300],
            invalid_results=q.invalid[engine_id],
        )
        return due

    async def invalid_result(self, live: Live, engine_id: str, reason: str) -> None:
        """A turn result that failed the scheduler's checks: it touches nothing, the turn fails
        (`engine_invalid`) and is retried on another engine; an engine that keeps sending such
        results is taken out of routing for the rest of its lease."""
        live.last_error = f"{engine_id}: invalid result: {reason}"
        if self.count_invalid(engine_id, reason):
            await self.take_out(engine_id, reason)
        await self.inflight.retry_or_fail(live, "engine_invalid", avoid=engine_id)

    async def take_out(self, engine_id: str, reason: str) -> None:
        self.quarantine.take_out(engine_id, self.tokens[engine_id])
        self.log.error(
            "engine_quarantined",
            engine_id=engine_id,
            invalid_results=self.quarantine.invalid[engine_id],
            last_reason=reason[:300],
            detail="no more turns go to it until it restarts under a new lease",
        )
        await self.set_engines(self._plan_engines, self._plan_moved)
