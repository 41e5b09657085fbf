"""The hybrid pool's data-parallel group with real processes (gloo over TCP): a replica that joins
the trainer's group makes the same updates as the trainer alone on the same batches and ends each
step with the trainer's weights; a replica killed mid-generation, or one that never comes to a
join, costs the trainer one failed attempt and nothing else (it trains on alone)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.localstack import Server
from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.hybrid import GroupBroken, TrainerGroup
from services.learning.learner import Learner
from tests.dp_rig import assert_same_update, samples

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _learner(model: ModelConfig, tmp: Path) -> Learner:
    run = RunConfig.model_validate({"model": model.model_dump(), "training": {"micro_batch": 2}})
    # the update is the gradient itself, scaled up to well above float32's rounding of the weights
    # (past the config's bound on lr, which is for AdamW; the step sets the optimizer's lr from it)
    run.training.lr = 1000.0
    learner = Learner(LearnJob.of(run), tmp)
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=1000.0)
    return learner


def _replica(group: TrainerGroup, rank: int, world: int, model: ModelConfig, out: Path, *extra: str):
    """A member of `group`'s current generation, told its rendezvous key as the bus would."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [str(x) for x in (group.port, group.generation, group.key, rank, world, model.cache_dir, out)]
    return subprocess.Popen([sys.executable, "-m", "tests.hybrid_rig", *argv, *extra], cwd=ROOT, env=env)


def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_a_replica_in_the_group_gives_the_trainer_alone_update_and_leaves_on_close(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    alone = _learner(tiny_model, tmp_path / "alone")
    initial = _weights(alone.model)
    batches = [samples()[:6], samples()[2:]]
    for b in batches:
        assert alone.step(b).data_parallel == 1
    expected = _weights(alone.model)

    trainer = _learner(tiny_model, tmp_path / "trainer")
    group = TrainerGroup("127.0.0.1", 0, timeout_s=30)
    group.next_generation(["engine-1"], [7])
    proc = _replica(group, 1, 2, tiny_model, tmp_path)
    try:
        sent = group.form(trainer.model)  # the replica's state fetch: the trainer's weights
        assert sent > 0 and group.world == 2
        stats = [trainer.step(b, group=group) for b in batches]
        assert [s.data_parallel for s in stats] == [2, 2] and trainer.group_error == ""
        group.close()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    got = _weights(trainer.model)
    assert_same_update(got, expected, initial)
    replica = torch.load(tmp_path / "replica-1.pt")
    assert all(torch.equal(replica[k], got[k]) for k in got), (
        "the replica ends each step on the trainer's weights"
    )
    assert json.loads((tmp_path / "replica-1.json").read_text()) == {"outcome": "closed", "steps": 2}
    assert group.world == 1 and group.pg is None


def test_a_replica_killed_mid_generation_costs_one_attempt_and_the_trainer_goes_on_alone(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    alone = _learner(tiny_model, tmp_path / "alone")
    alone.step(samples())
    expected = _weights(alone.model)

    trainer = _learner(tiny_model, tmp_path / "trainer")
    group = TrainerGroup("127.0.0.1", 0, timeout_s=20)
    group.next_generation(["engine-1"], [7])
    proc = _replica(group, 1, 2, tiny_model, tmp_path, "die-after-join")
    try:
        group.form(trainer.model)
        assert proc.wait(timeout=120) == 3 and (tmp_path / "joined-1").exists()
        stats = trainer.step(samples(), group=group)  # the replica is gone: the step runs alone
    finally:
        proc.kill()
    assert stats.data_parallel == 1 and trainer.group_error and group.pg is None
    got = _weights(trainer.model)
    for k in got:
        assert torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-6), k


def test_a_member_that_never_comes_to_the_join_fails_the_generation_not_the_trainer(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    """Two members announced, one comes (the other was killed while joining): the generation does
    not form within its timeout, on either side; the next one, without the dead member, does."""
    trainer = _learner(tiny_model, tmp_path / "trainer")
    group = TrainerGroup("127.0.0.1", 0, timeout_s=5)
    gen = group.next_generation(["engine-1", "engine-2"], [7, 8])
    lonely = _replica(group, 1, 3, tiny_model, tmp_path, "timeout=6")  # gives up soon, as the trainer
    try:
        with pytest.raises(GroupBroken):
            group.form(trainer.model)
        assert lonely.wait(timeout=120) != 0, "its side of the generation fails too"
        assert group.pg is None and trainer.step(samples()).data_parallel == 1
        gen = group.next_generation(["engine-1"], [7])
        group.timeout_s = (
            60  # the new replica process starts torch and the model first: slow on a busy machine
        )
        again = _replica(group, 1, 2, tiny_model, tmp_path)
        group.form(trainer.model)
        assert trainer.step(samples(), group=group).data_parallel == 2
        group.close()
        assert again.wait(timeout=120) == 0
    finally:
        lonely.kill()
        if "again" in locals():
            again.kill()


def test_a_process_without_the_generations_key_cannot_take_a_rank(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    """Anything that reaches the trainer's rendezvous port, knowing the generation and its rank but
    not the key its members were told, meets nobody: the generation does not form with it, and the
    trainer goes on alone."""
    import threading

    from services.learning.hybrid import _form

    trainer = _learner(tiny_model, tmp_path / "trainer")
    group = TrainerGroup("127.0.0.1", 0, timeout_s=4)
    gen = group.next_generation(["engine-1"], [7])
    outcome: list[str] = []

    def intruder() -> None:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", group.port, is_master=False)
        for guess in ("", "0" * 32):
            try:
                _form(store, gen, guess, 1, 2, 4.0)
                outcome.append(f"joined with {guess!r}")
            except GroupBroken:
                outcome.append("refused")

    t = threading.Thread(target=intruder, daemon=True)
    t.start()
    with pytest.raises(GroupBroken):
        group.form(trainer.model)
    t.join(30)
    assert outcome == ["refused", "refused"] and group.pg is None
    assert trainer.step(samples()).data_parallel == 1


async def test_the_trainer_takes_only_workers_the_plan_gives_the_hybrid_role_under_a_live_token(
    nats_server: Server, redis_server: Server, run_id: str
) -> None:
    """A `ready` is refused (with a reason, on the bus) from a worker the plan does not have in the
    hybrid role, under another token than the plan's, or whose lease token is no longer current
    in Redis; the right one is taken for the next step boundary."""
    from services.common import subjects
    from services.common.bus import Bus, Envelope
    from services.common.contracts import ev
    from services.common.membership import Membership, lease_resource
    from services.common.ownership import OwnershipStore
    from services.trainer.config import TrainerSettings
    from services.trainer.hybrid_host import HybridHost
    from tests.speaking import speak

    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "trainer", "trainer-0")
    worker = await Bus.connect(nats_server.url, run_id, "rollout-engine", "engine-1")
    refused: list[ev.HybridState] = []

    async def on_state(m: ev.HybridState, _: Envelope) -> None:
        if m.state == "refused":
            refused.append(m)

    try:
        await worker.subscribe(subjects.HYBRID_STATE, ev.HybridState, on_state)
        live = await store.acquire(lease_resource("hybrid", "engine-1"), "engine-1", 30.0)
        old = await store.acquire(lease_resource("hybrid", "engine-2"), "engine-2", 30.0)
        assert live is not None and old is not None
        membership = Membership(bus, store, ev.WorkerHello(worker_id="trainer-0", kind="trainer"))
        plan = ev.Plan(
            plan_version=1,
            planner_epoch=1,
            assignments=[
                ev.Assignment(worker_id="engine-1", role="hybrid", fencing_token=live.token),
                ev.Assignment(worker_id="engine-2", role="hybrid", fencing_token=old.token),
                ev.Assignment(worker_id="engine-3", role="rollout", fencing_token=5),
            ],
        )
        await membership._apply(plan)
        await store.r.delete(f"libra:{run_id}:lease:{lease_resource('hybrid', 'engine-2')}")
        host = HybridHost(TrainerSettings(), bus, store, membership, lambda: None)
        await host.start()
        readies = (
            ("engine-3", 5),  # not in the hybrid role
            ("engine-1", live.token + 1),  # not the plan's token
            ("engine-2", old.token),  # its lease is gone (expired: the worker may be dead)
            ("engine-1", live.token),
        )
        # said again each second until answered: a worker's ready repeats while it waits (in clean-
        # clone CI once, under load, none of four readies sent right after connecting was answered
        # in 20 s; the same pattern as test_nats_over_mutual_tls's hello)
        for i in range(400):
            if len({(r.worker_id, r.fencing_token) for r in refused}) == 3 and host.ready:
                break
            if i % 20 == 0:
                for wid, token in readies:
                    await speak(
                        worker,
                        subjects.HYBRID_STATE,
                        ev.HybridState(worker_id=wid, state="ready", fencing_token=token),
                        "rollout-engine",
                    )
            await asyncio.sleep(0.05)
        stats = {b.worker_id: (b.nc.stats, b.published, b.received, b.rejected) for b in (bus, worker)}
        # each ready is checked on its own (the lease check awaits Redis): answers may cross
        by_worker = {(r.worker_id, r.fencing_token): r.detail for r in refused}
        assert set(by_worker) == {("engine-3", 5), ("engine-1", live.token + 1), ("engine-2", old.token)}, (
            refused,
            stats,
        )
        assert "stale ownership token" in by_worker[("engine-2", old.token)]
        assert host.ready == {"engine-1": live.token}
    finally:
        for b in (bus, worker):
            await b.close()
        await store.close()
