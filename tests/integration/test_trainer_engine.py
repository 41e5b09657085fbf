"""The trainer serving lent turns itself (planner.lending.trainer_serves): a real planner, NATS and
Redis, a real learner on the tiny model, and the trainer's own engine in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.localstack import Server
from services.common.membership import Membership
from services.common.ownership import OwnershipStore
from services.common.runconfig import EngineJob, ModelConfig, RunConfig
from services.learning.learner import Learner
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from services.trainer.config import TrainerSettings
from services.trainer.hybrid_host import HybridHost
from services.trainer.leadership import Leadership
from services.trainer.serving import TrainerEngine

pytestmark = pytest.mark.integration


def _turn(request_id: str, max_new: int, min_new: int = 0) -> ev.TurnRequest:
    return ev.TurnRequest(
        request_id=request_id,
        trajectory_id=f"t-{request_id}",
        context_token_ids=list(range(100, 120)),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=1.0,
        sampling_seed=7,
    )


async def test_the_trainer_serves_lent_turns_with_its_own_weights_and_trains_only_when_parked(
    nats_server: Server, redis_server: Server, run_id: str, tiny_model: ModelConfig, tmp_path: Path
) -> None:
    """Parked at start (turns refused), lent by the trainer's request (turns answered as
    `trainer-a-engine` with the learner's version), parked again with a long turn running (handed
    back with the tokens it has), then trained inside `training()`; lent again it serves the new
    weights at once, with no push: the same seed and context now give other tokens, at the new
    version. A roll-back while lent parks it before the weights are restored."""
    cfg = RunConfig.model_validate(
        {
            "model": tiny_model.model_dump(),
            "task": {"max_new_tokens": 2000},
            "rollout": {"engines": 1, "backend": "hf"},
            "planner": {"lending": {"engines": 1, "trainer_serves": True}},
        }
    )
    assert cfg.engines_needed == 1  # no engine process stands for the training GPUs
    store = OwnershipStore.from_url(redis_server.url, run_id)
    pbus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, pbus, store)
    await planner.start()
    tbus = await Bus.connect(nats_server.url, run_id, "trainer", "trainer-a")
    trainer = Membership(tbus, store, ev.WorkerHello(worker_id="trainer-a", kind="trainer"))
    await trainer.start()
    token = (await trainer.wait_assigned(10)).fencing_token
    learner = await asyncio.to_thread(Learner, cfg, tmp_path / "ckpt")
    common = CommonSettings(nats_url=nats_server.url, redis_url=redis_server.url, run_id=run_id)
    own = TrainerEngine(
        common,
        EngineJob.of(cfg),
        (cfg.lending_bucket, cfg.planner.lending.tensor_parallel),
        learner,
        store,
        "trainer-a",
    )
    sched = await Bus.connect(nats_server.url, run_id, "scheduler", "scheduler")
    results: dict[str, ev.TurnResult] = {}

    async def on_result(r: ev.TurnResult, env: Envelope) -> None:
        results[r.request_id] = r

    await sched.subscribe(subjects.TURN_RESULT, ev.TurnResult, on_result)
    target = f"{subjects.TURN_REQUEST}.trainer-a-engine"

    async def answer(req: ev.TurnRequest) -> ev.TurnResult:
        await sched.publish(target, req)
        async with asyncio.timeout(30):
            while req.request_id not in results:
                await asyncio.sleep(0.02)
        return results[req.request_id]

    async def ask(want: str) -> None:
        reply = await tbus.request(
            subjects.LEND_REQUEST, ev.LendRequest(want=want, fencing_token=token), ev.LendReply
        )
        assert list(reply.workers) == ["trainer-a-engine"]
        async with asyncio.timeout(10):
            while own.membership.plan is None or own.membership.plan.plan_version < reply.plan_version:
                await asyncio.sleep(0.02)

    try:
        await own.start()
        async with asyncio.timeout(10):
            while own.membership.assignment is None:
                await asyncio.sleep(0.02)
        a = own.membership.assignment
        assert (a.role, a.bucket, a.tensor_parallel) == ("parked", cfg.lending_bucket, 1)
        refused = await answer(_turn("parked", 8))
        assert refused.error.code == "unavailable" and "draining" in refused.error.message

        await ask("lend")
        first = await answer(_turn("lent", 8))
        assert not first.HasField("error") or not first.error.code, first.error
        assert first.engine_id == "trainer-a-engine" and first.policy_version == learner.state.version == 0
        assert len(first.token_ids) == len(first.logprobs) > 0

        await sched.publish(target, _turn("long", 2000, min_new=2000))
        async with asyncio.timeout(30):
            while own.batcher.tokens_generated < 8 + 5:  # the long turn is generating
                await asyncio.sleep(0.02)
        await ask("reclaim")
        async with asyncio.timeout(30):
            while "long" not in results:
                await asyncio.sleep(0.02)
        handed = results["long"]
        assert handed.error.code == "handed_back" and 0 < len(handed.token_ids) < 2000
        async with own.training():  # the trainer's step: the model is its own
            with torch.no_grad():
                w = learner.model.lm_head.weight  # tied to the embedding: a sign flip would nearly cancel
                w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
            learner.state.version = 1
            async with asyncio.timeout(5), own.training():  # a step that rolls back holds it already
                pass

        await ask("lend")
        second = await answer(_turn("again", 8))
        assert second.policy_version == 1 and second.engine_id == "trainer-a-engine"
        assert second.token_ids != first.token_ids, "the same seed on the trainer's new weights"
        assert own.turns_answered == 3, list(own.answered)  # lent, long (its tokens so far), again

        # the trainer lost and regained its lease while lent: its roll-back (here to the initial
        # weights, no checkpoint) parks the engine first; lent again, it serves what it rolled back to
        hybrid = HybridHost(
            TrainerSettings(), tbus, store, trainer, lambda: learner.model, unsupported="test"
        )
        lead = Leadership(tbus, store, trainer, learner, hybrid, lambda: None, model_owned=own.training)
        await lead.roll_back({"step": "0", "checkpoint": ""})
        assert own.draining and learner.state.version == 0
        refused = await answer(_turn("rolled-back", 8))
        assert refused.error.code == "unavailable", refused.error
        await ask("reclaim")
        await ask("lend")
        third = await answer(_turn("initial", 8))
        assert third.policy_version == 0 and third.token_ids == first.token_ids
    finally:
        await own.shutdown()
        for b in (sched, tbus, pbus):
            await b.close()
            await b.nc.close()
        learner.close()
        await store.close()
