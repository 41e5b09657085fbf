"""The trainer's side of lending its GPUs to rollout (planner.lending): while it waits for a
batch of complete groups it asks the planner to lend the engines standing for its GPUs, and
before its next step to take them back, then waits for its GPUs to switch back. When to do either
is the policy's (`services.policy.lend_policy`, the simulator's too): from the times recent groups
became complete, it lends only when the batch is forecast far enough off to repay both switches,
and takes the GPUs back one switch before the batch is forecast complete.

The planner moves the engines (`parked` <-> `lent`) under the trainer's fencing token; a lent
engine hands its running turns back with their tokens when it is parked again, and they continue
on other engines. Each move costs the switch time (`services.common.lending.switch_s`): the
engines pay it when lent (turns wait for their GPUs), the trainer when it takes them back, plus
whatever of the lending switch is still under way (its GPUs are mid-switch).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.membership import LENT_ROLE, PARKED_ROLE, Membership
from services.common.runconfig import LendingConfig
from services.common.tracing import tracer
from services.policy.lend_policy import LendPolicy


class Lender:
    def __init__(
        self,
        lend: LendingConfig,
        switch_s: float,
        lent_share: float,
        need: int,
        bus: Bus,
        membership: Membership,
        token: Callable[[], int],
        step: Callable[[], int],
        lent: Callable[[], None],
        timeout_s: float,
    ):
        self.bus, self.membership, self.token, self.step, self.on_lent = bus, membership, token, step, lent
        """Lends as `lend` (planner.lending) says; `switch_s` and `lent_share` are the job's
        (`services.common.lending`), `need` the groups a step takes (training.groups_per_step)."""
        self.enabled = lend.engines > 0
        self.switch_s = switch_s
        self.policy = LendPolicy(switch_s, lend.policy, lent_share=lent_share)
        self._ready: Callable[[], int] | None = None
        """The complete groups this trainer holds (from `watch`)."""
        self.need = need
        self.timeout_s = timeout_s
        self._heard: OrderedDict[str, None] = OrderedDict()
        """Groups the forecast has heard of (a group redelivered after a hand-back counts once)."""
        self._moving = asyncio.Lock()
        """One move of the GPUs at a time (the watcher's early reclaim, the step's own)."""
        self.lent_at: float | None = None
        """When its GPUs went to rollout (monotonic); None while they are the trainer's."""
        self.lends = self.reclaims = self.early_reclaims = 0
        self.seconds_lent = 0.0
        self.log = get_logger(component="trainer")

    def group_complete(self, group_id: str, at: float) -> None:
        """The trainer holds every trajectory of a group, the last finished at `at` (wall clock,
        the scheduler's): the forecast hears of it once."""
        if group_id in self._heard:
            return
        self._heard[group_id] = None
        while len(self._heard) > 4096:
            self._heard.popitem(last=False)
        self.policy.completed(at)
        if self._ready is not None and self._ready() >= self.need:
            self.policy.batch_complete()

    async def watch(self, ready: Callable[[], int], every_s: float = 0.25) -> None:
        """Takes lent GPUs back when the policy says so (`ready`: the complete groups this trainer
        holds; while it waits it fetches whatever completes)."""
        self._ready = ready
        while True:
            await asyncio.sleep(every_s)
            if self.lent_at is None or not self.policy.should_reclaim(time.time(), ready(), self.need):
                continue
            try:
                await self.reclaim(early=True)
            except Exception as err:  # the step's own reclaim takes them back, whatever this was
                self.log.warning("early_reclaim_failed", error=f"{type(err).__name__}: {err}")

    async def waiting(self, ready: int) -> None:
        """No batch is complete (`ready` groups are): lend the GPUs if the policy says it pays."""
        if self.policy.should_lend(time.time(), ready, self.need):
            await self.lend()

    async def lend(self) -> None:
        """The trainer waits for its batch: its GPUs serve rollout meanwhile (if any is parked)."""
        async with self._moving:
            await self._lend()

    async def _lend(self) -> None:
        if not self.enabled or self.lent_at is not None or not self.membership.peers(PARKED_ROLE):
            return
        reply = await self._ask("lend", once=True)
        if reply is None or not reply.workers:
            return
        self.lent_at = time.monotonic()
        self.lends += 1
        self.log.info("gpus_lent", engines=list(reply.workers), switch_s=round(self.switch_s, 3))
        # until it follows the plan that lent them (its pushes go to the plan's engines)
        await self.membership.plan_at_least(reply.plan_version, timeout=5.0)
        self.on_lent()  # they get the current weights (on GPUs the trainer's own: no copy)

    async def reclaim(self, early: bool = False) -> None:
        """A batch is ready (or forecast within a switch, `early`): the GPUs come back before the
        step (also ones a trainer before this one lent and never took back). A planner that does
        not answer within `timeout_s` (restarting) does not stop training: the step goes on, and
        the engines are taken back next time."""
        async with self._moving:
            await self._reclaim(early)

    async def _reclaim(self, early: bool) -> None:
        if not self.enabled or (self.lent_at is None and not self.membership.peers(LENT_ROLE)):
            return
        if early and self.lent_at is None:
            return
        start = time.monotonic()
        with tracer().start_as_current_span("train.reclaim") as span:
            reply = await self._ask("reclaim", once=False)
            if reply is None:
                self.log.warning("gpus_not_reclaimed", waited_s=round(time.monotonic() - start, 3))
                return
            now = time.monotonic()
            switching = max(0.0, self.lent_at + self.switch_s - now) if self.lent_at is not None else 0.0
            wait = switching + self.switch_s if reply.workers else switching
            await asyncio.sleep(wait)
            if self.lent_at is not None:
                self.seconds_lent += now - self.lent_at
            if self.lent_at is not None or reply.workers:
                self.reclaims += 1
                self.early_reclaims += early
            self.lent_at = None
            span.set_attribute("libra.engines", len(reply.workers))
            span.set_attribute("libra.switch_s", wait)
            span.set_attribute("libra.early", early)
        self.log.info("gpus_reclaimed", engines=list(reply.workers), switch_s=round(wait, 3), early=early)

    async def _ask(self, want: str, once: bool) -> ev.LendReply | None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return await self.bus.request(
                    subjects.LEND_REQUEST,
                    ev.LendRequest(want=want, fencing_token=self.token(), step=self.step()),
                    ev.LendReply,
                    timeout=min(5.0, self.timeout_s),
                )
            except Exception as err:  # refused (Refused), or no planner answered (restarting)
                error = f"{type(err).__name__}: {err}"
            if once or time.monotonic() >= deadline:
                self.log.warning("lend_request_failed", want=want, error=error)
                return None
            await asyncio.sleep(0.5)
