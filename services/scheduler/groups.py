"""The scheduler's groups: launched from the feed under the staleness bound (the service's tick
takes the tickets), their outcomes from the trainer in, those the trainer can no longer take ended
early, evaluation rounds, and a restarted scheduler's run resumed from its ledger."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Collection
from typing import Any

from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.runconfig import TaskConfig
from services.common.streams import SCHEDULER_FEED
from services.policy.staleness import StalenessBound
from services.scheduler.completion import Completion
from services.scheduler.driver import TrajectoryDriver
from services.scheduler.episodes import Episode
from services.scheduler.evaluation import Evaluator
from services.scheduler.feed import GroupTicket, TaskFeed
from services.scheduler.inflight import InFlight
from services.scheduler.ledger import Ledger, durably
from services.scheduler.prompting import Prompter
from services.scheduler.trajectory import doomed_groups
from services.scheduler.versions import TrainedVersion


class Groups:
    def __init__(
        self,
        task: TaskConfig,
        max_staleness: int,
        bus: Bus,
        feed: TaskFeed,
        ledger: Ledger,
        episode: Episode,
        driver: TrajectoryDriver,
        completion: Completion,
        versions: TrainedVersion,
    ):
        """Launches `task`'s groups; aborts those older than `max_staleness` allows (training.max_staleness)."""
        self.task, self.max_staleness = task, max_staleness
        self.bus, self.feed, self.ledger = bus, feed, ledger
        self.episode, self.driver, self.completion, self.versions = episode, driver, completion, versions
        self.log = get_logger(component="scheduler")
        self.aborted = 0
        """Groups ended early because the trainer could no longer take them (`abort_hopeless`)."""
        self._eval_nonce = uuid.uuid4().hex[:6]
        self.outcomes: Any = None

    async def bind(self) -> None:
        """The trainer's group outcomes: the scheduler's durable consumer of them."""
        self.outcomes, _ = await self.bus.bind_consumer(SCHEDULER_FEED)

    async def abort_hopeless(self, inflight: InFlight) -> None:
        """Ends the in-flight trajectories of groups the trainer can no longer take: a member's
        first tokens are older than the staleness bound allows at the trained version (the bound
        only tightens), so the whole group would be dropped when it completes. They end as failed
        (`stale`, never trained), their engine slots free at once, and the feed replaces the group,
        instead of the group running to the end for nothing (the simulator aborts them the same way)."""
        trajs = [lv.traj for lv in inflight.all() if not lv.evaluation]
        version, bound = self.versions.version, self.max_staleness
        doomed = doomed_groups(trajs, version, StalenessBound(bound))
        if not doomed:
            return
        await self.driver.abort_groups(
            doomed,
            lambda group: (
                f"group {group} can no longer be trained at version {version} (max_staleness {bound})"
            ),
        )
        self.aborted += len(doomed)

    async def resume(self, evaluator: Evaluator | None, prompter: Prompter) -> None:
        """Continues an earlier scheduler's run of this job from the ledger, if there was one."""
        began = time.monotonic()
        if evaluator is not None:
            evaluator.done.update(await self.ledger.load_eval())
        state = await self.ledger.load()
        if state is None:
            return
        read = time.monotonic()
        outstanding = self.feed.restore(
            launched=state.launched,
            replaced=state.replaced,
            total_groups=state.total_groups,
            outstanding=list(state.outstanding.values()),
            outcomes=state.outcomes,
        )
        self.completion.completed, self.completion.failed = state.completed, state.failed
        self.versions.version = await self.versions.committed()
        versioned = time.monotonic()
        reissued = 0
        for ticket in outstanding:
            reissued += self.launch(ticket, skip=state.published)
        self.log.info(
            "scheduler_resumed",
            groups_launched=state.launched,
            groups_outstanding=len(outstanding),
            trajectories_reissued=reissued,
            trained_version=self.versions.version,
            # reading the ledger, the trained version, and starting the re-issued trajectories
            phases_s={
                "ledger": round(read - began, 3),
                "version": round(versioned - read, 3),
                "relaunch": round(time.monotonic() - versioned, 3),
            },
        )

    async def consume_outcomes(self) -> None:
        try:
            fetched = await self.bus.fetch(self.outcomes, ev.GroupOutcome, 64, 0.01)
        except Exception as err:  # NATS reconnecting: the outcomes stay on the stream
            self.log.warning("outcome_fetch_failed", error=str(err))
            return
        for out, raw in fetched:
            trained = list(out.trained_ids) if out.outcome == "trained" else []
            if out.group_id in self.feed.outstanding:
                replaced = self.feed.resolve(out.group_id, out.outcome)
                await durably(self.ledger.resolved(self.feed, out.group_id, out.outcome, trained), self.log)
                if replaced:
                    self.log.info(
                        "group_replaced", group_id=out.group_id, outcome=out.outcome, reason=out.reason
                    )
            elif trained:
                await durably(self.ledger.heard_trained(trained), self.log)
            with contextlib.suppress(Exception):
                await raw.ack()

    def launch(self, ticket: GroupTicket, skip: Collection[str] = ()) -> int:
        """Starts the group's trajectories (but those in `skip`, already with the trainer)."""
        size = self.task.group_size
        members = self.episode.members(ticket, self.versions.version, size)
        launched = 0
        for i, member in enumerate(members):
            if ticket.trajectory_id(i) in skip:
                continue
            launched += 1
            self.driver.start(
                (ticket.trajectory_id(i), ticket.group_id, i, size),
                ticket.task,
                member.prompt_ids,
                member.script,
                self.versions.version,
                self.task.temperature,
            )
        return launched

    def launch_eval(self, evaluator: Evaluator, prompter: Prompter, version: int) -> None:
        """An evaluation round of the policy at `version`: `eval.samples` trajectories per held-out
        prompt, each its own group of one, whose turns wait for engines that hold that version."""
        rnd = evaluator.start(version, self._eval_nonce)
        for i in range(rnd.total):
            task = evaluator.tasks[i // rnd.samples]
            tid = rnd.trajectory_id(i)
            self.driver.start(
                (tid, tid, 0, 1),
                task,
                prompter.prompt_ids(task),
                None,
                version,
                evaluator.temperature,
                evaluation=True,
            )
        self.log.info("eval_started", policy_version=version, prompts=rnd.total)
