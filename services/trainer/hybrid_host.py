"""The trainer's side of the hybrid pool: which workers are in its data-parallel group, and when.

A worker the plan moves to the `hybrid` role drains, loads its training side and says `ready`
(`hybrid.state`, with its lease token). The trainer takes it in at its next step boundary (it is
between steps whenever this runs): it closes the current generation, publishes the next one on
`hybrid.group` and meets its members, sending them its weights. A worker the plan moves back out
is left out of the next generation the same way. Joins are fenced twice: the plan must give the
worker the `hybrid` role under that token, and the token must hold the worker's lease in Redis
(a restarted or replaced worker's old token is refused). A generation that does not form, or
breaks, costs the trainer that attempt only: it trains on alone and the workers ask again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.membership import HYBRID_ROLE, Membership, lease_resource
from services.common.ownership import OwnershipStore
from services.common.tasks import in_daemon_thread
from services.common.tracing import tracer
from services.trainer.config import TrainerSettings

if TYPE_CHECKING:
    from services.learning.hybrid import TrainerGroup


class HybridHost:
    def __init__(
        self,
        settings: TrainerSettings,
        bus: Bus,
        store: OwnershipStore,
        membership: Membership,
        model: Callable[[], Any],
        unsupported: str = "",
    ):
        self.settings, self.bus, self.store, self.membership = settings, bus, store, membership
        self.model = model
        self.unsupported = unsupported
        """Why this trainer cannot take hybrid workers ('' when it can)."""
        self.group: TrainerGroup | None = None
        self.ready: dict[str, int] = {}
        self._last_command = time.monotonic()
        self.log = get_logger(component="hybrid")

    async def start(self) -> None:
        await self.bus.subscribe(subjects.HYBRID_STATE, ev.HybridState, self._on_state)

    def _planned(self) -> dict[str, int]:
        """Workers the plan gives the hybrid role, with their tokens."""
        return {a.worker_id: a.fencing_token for a in self.membership.peers(HYBRID_ROLE)}

    async def _on_state(self, msg: ev.HybridState, _: Envelope) -> None:
        if msg.state != "ready":
            return
        wid, token = msg.worker_id, msg.fencing_token
        if self.unsupported:
            return await self._refuse(wid, token, self.unsupported)
        if self._planned().get(wid) != token:
            return await self._refuse(
                wid, token, "the plan does not give it the hybrid role under that token"
            )
        if not await self.store.is_current(lease_resource(HYBRID_ROLE, wid), token):
            return await self._refuse(wid, token, "stale ownership token")
        if wid not in self.ready:
            self.log.info("hybrid_worker_ready", worker_id=wid, fencing_token=token)
        self.ready[wid] = token

    async def _refuse(self, wid: str, token: int, why: str) -> None:
        self.log.warning("hybrid_join_refused", worker_id=wid, fencing_token=token, reason=why)
        await self.bus.publish(
            subjects.HYBRID_STATE,
            ev.HybridState(worker_id=wid, state="refused", fencing_token=token, detail=why),
        )

    @property
    def members(self) -> list[str]:
        return list(self.group.members) if self.group is not None and self.group.pg is not None else []

    async def tick(self, leading: bool, trainer_token: int) -> None:
        """At a step boundary: re-forms the group when the ready workers the plan still wants are
        not its members, or keeps the current one alive. Without the trainer role, holds none."""
        planned = self._planned()
        self.ready = {w: t for w, t in self.ready.items() if planned.get(w) == t}
        want = sorted(self.ready) if leading else []
        if want == self.members:
            if want and time.monotonic() - self._last_command >= self.settings.hybrid_ping_s:
                await self._command(lambda g: g.ping(), "ping")
            return
        await self.close()
        if not want:
            return
        group = await self._host()
        gen = group.next_generation(want, [self.ready[w] for w in want])
        await self.bus.publish(
            subjects.HYBRID_GROUP,
            ev.HybridGroup(
                generation=gen,
                store_addr=f"{self.settings.hybrid_advertise_host or self.settings.hybrid_host}:{group.port}",
                members=want,
                member_tokens=group.tokens,
                trainer_token=trainer_token,
                timeout_s=self.settings.hybrid_timeout_s,
                rendezvous_key=group.key,
            ),
        )
        start = time.monotonic()
        model = self.model()
        attrs: dict[str, Any] = {"libra.generation": gen, "libra.members": want}
        with tracer().start_as_current_span("hybrid.join", attributes=attrs) as span:
            try:
                sent = await in_daemon_thread(lambda: group.form(model))
            except Exception as err:
                span.set_attribute("libra.error", str(err)[:300])
                self.log.warning("hybrid_group_failed", generation=gen, members=want, error=str(err))
                self.ready.clear()  # whoever is alive says ready again
                return
            span.set_attribute("libra.weights_bytes", sent)
        self._last_command = time.monotonic()
        self.log.info(
            "hybrid_group_formed",
            generation=gen,
            members=want,
            join_s=round(time.monotonic() - start, 3),
            weights_bytes=sent,
        )

    async def _host(self) -> TrainerGroup:
        if self.group is None:
            from services.learning.hybrid import TrainerGroup

            s = self.settings
            self.group = await asyncio.to_thread(
                TrainerGroup, s.hybrid_host, s.hybrid_port, s.hybrid_timeout_s
            )
            self.log.info("hybrid_rendezvous", host=s.hybrid_host, port=self.group.port)
        return self.group

    async def _command(self, fn: Callable[[TrainerGroup], None], what: str) -> None:
        group = self.group
        if group is None or group.pg is None:
            return
        try:
            await in_daemon_thread(lambda: fn(group))
        except Exception as err:
            self.log.warning("hybrid_group_broken", during=what, error=str(err))
            self.ready.clear()
        self._last_command = time.monotonic()

    def stepped(self, error: str) -> None:
        """After a step: a group that broke during it is gone (the step was done alone)."""
        self._last_command = time.monotonic()
        if error:
            self.log.warning("hybrid_group_broken", during="step", error=error)
            self.ready.clear()

    async def close(self) -> None:
        """Ends the current generation (its members go back to asking for a place)."""
        if self.members:
            self.log.info("hybrid_group_closed", generation=self.group.generation if self.group else 0)
        await self._command(lambda g: g.close(), "close")
