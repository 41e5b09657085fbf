"""The trainer's intake on a real nats-server and Redis with the tiny model's learner: while one step
trains, the next batch is fetched and grouped, and a trajectory of the step being trained delivered
again is settled with that step, never buffered to be trained twice."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.models import load_model
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig, RunConfig
from services.learning.learner import Learner
from services.trainer.config import TrainerSettings
from services.trainer.intake import Intake
from tests.integration.test_trainer_service import make_group

pytestmark = pytest.mark.integration


async def test_the_next_batch_is_grouped_while_a_step_trains(
    nats_server, redis_server, run_id: str, tiny_model: ModelConfig, tmp_path: Path
) -> None:
    run = RunConfig.model_validate(
        {
            "model": tiny_model.model_dump(),
            "task": {"group_size": 2},
            "training": {"groups_per_step": 1, "torch_threads": 1, "checkpoint_dir": str(tmp_path)},
        }
    )
    learner = await asyncio.to_thread(Learner, run, tmp_path)
    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "trainer", "trainer-0")
    scheduler = await Bus.connect(nats_server.url, run_id, "scheduler", "scheduler-0")
    intake = Intake(
        run_id,
        run.training,
        run.task.group_size,
        run.filters_zero_advantage,
        TrainerSettings(),
        bus,
        store,
        learner,
    )
    model = load_model(tiny_model)

    async def publish(t: object) -> None:  # as the scheduler does: once per trajectory
        await scheduler.publish_durable(subjects.TRAJ_COMPLETED, t, msg_id=uuid.uuid4().hex)  # type: ignore[arg-type]

    try:
        await intake.open()
        first, second = make_group(model, "g0", 2, seed=1), make_group(model, "g1", 2, seed=2)
        for t in first:
            await publish(t)
        while intake.groups_complete() < 1:
            await intake.admit(await intake.fetch(timeout_s=0.5))
        (group,) = await intake.take()
        intake.stepping = group  # as `_step` sets it

        during: list[int] = []

        async def step() -> str:
            # the step trains; meanwhile the scheduler completes the next group, and a trajectory
            # of this step is delivered again (a scheduler re-sending after its restart)
            for t in [first[0], *second]:  # in stream order: fetched before the group completes
                await publish(t)
            for _ in range(200):
                if intake.groups_complete() >= 1:
                    break
                await asyncio.sleep(0.05)
            during.append(intake.groups_complete())
            await asyncio.sleep(0.5)  # the second delivery of first[0] is fetched by now too
            return "stepped"

        assert await intake.while_stepping(step(), need=1) == "stepped"
        assert during == [1], "the next group was fetched and grouped before the step ended"
        assert {p.traj.trajectory_id for g in intake.buffer.groups.values() for p in g.values()} == {
            t.trajectory_id for t in second
        }
        again = next(p for p in group if p.traj.trajectory_id == first[0].trajectory_id)
        assert len(again.handles) == 2, "delivered again during its step: settled with the step"
        # the step commits: its deliveries, both of first[0]'s included, are acked; the next
        # group's are held, not acked before their own step
        await intake.trained([group])
        info = await bus.js.consumer_info(subjects.stream_name(run_id, "TRAJ"), "trainer")
        for _ in range(100):
            info = await bus.js.consumer_info(subjects.stream_name(run_id, "TRAJ"), "trainer")
            if info.num_ack_pending == len(second):
                break
            await asyncio.sleep(0.05)
        assert (info.num_ack_pending, info.num_pending) == (len(second), 0)
    finally:
        for b in (bus, scheduler):
            await b.close()
        await store.close()
