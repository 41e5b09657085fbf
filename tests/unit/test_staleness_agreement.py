"""The simulator judges the code that runs: a simulated job's admissions, completions and aborts,
replayed through the live task feed and the live trainer's group buffer, launch the same number of
groups at each version and train the same groups at each step, in the same order, as the
simulator's training side did (both ask `services/policy/staleness.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.contracts import ev
from services.policy.staleness import StalenessBound, training_order
from services.scheduler.feed import TaskFeed
from services.scheduler.task import arithmetic_tasks
from services.simulation.simulator import Simulator
from services.trainer.batcher import GroupBuffer
from tests.unit.test_sim import N_GPUS, _env, _system


def _record(name: str, staleness: int, seed: int, steps: int = 6) -> tuple[list[tuple[Any, ...]], int]:
    env = _env(staleness)
    sim = Simulator(_system(name, env), env.workload, env.cm, N_GPUS, steps, seed=seed)
    sim.decisions = []
    sim.run()
    return sim.decisions, sim.B


def _replay(decisions: list[tuple[Any, ...]], staleness: int, B: int) -> dict[str, Any]:
    """Feeds the simulator's events to the live feed and group buffer; returns what they decided."""
    feed = TaskFeed(arithmetic_tasks(8, 0), groups_per_step=B, max_staleness=staleness, total_steps=10_000)
    buf: GroupBuffer[str] = GroupBuffer(staleness)
    gid = {}  # the simulator's group index -> the feed's group id, launched in the same order
    version = 0
    out: dict[str, Any] = {"launched": [], "trained": [], "dropped": set()}

    def resolve(group: int, outcome: str) -> None:
        feed.resolve(gid[group], outcome)

    for d in decisions:
        kind = d[0]
        if kind == "admit":
            _, version, n = d
            tickets = feed.take(version)
            out["launched"].append((version, len(tickets), n))
            for t in tickets:
                gid[len(gid)] = t.group_id
        elif kind == "done":
            _, group, tid, oldest, size, version = d
            traj = ev.CompletedTrajectory(
                trajectory_id=tid,
                group_id=gid[group],
                group_size=size,
                min_policy_version=oldest,
            )
            admission = buf.add(traj, tid, version)
            if admission.outcome == "stale":
                out["dropped"].add(group)
        elif kind == "abort":  # the scheduler ended the group's in-flight members: failed, never trained
            _, group, version = d
            buf.drop(gid[group])
            out["dropped"].add(group)
            resolve(group, "stale")
        elif kind == "drop":  # the live buffer dropped it already, when its stale member arrived
            _, group, version = d
            assert group in out["dropped"] or any(gid[group] == g for g, _, _ in buf.waiting()), d
            buf.drop(gid[group])
            out["dropped"].add(group)
            resolve(group, "stale")
        elif kind == "train":
            _, version, groups = d
            taken, stale = buf.take(B, version)
            by_id = {v: k for k, v in gid.items()}
            out["trained"].append((version, [by_id[g[0].traj.group_id] for g in taken], groups))
            for p in stale:
                out["dropped"].add(by_id[p.traj.group_id])
            for g in taken:
                resolve(by_id[g[0].traj.group_id], "trained")
    return out


@pytest.mark.parametrize("staleness", [0, 1, 2])
@pytest.mark.parametrize("name", ["libra", "areal", "homogeneous-lb"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_live_feed_and_trainer_decide_what_the_simulator_decided(name, staleness, seed):
    decisions, B = _record(name, staleness, seed)
    kinds = {d[0] for d in decisions}
    assert {"admit", "done", "train"} <= kinds
    out = _replay(decisions, staleness, B)
    # The feed releases exactly the groups the simulator admitted, at every version.
    assert all(live == simulated for _, live, simulated in out["launched"]), out["launched"]
    # Every step trains the same groups, in the same order.
    assert len(out["trained"]) == 6
    for version, live, simulated in out["trained"]:
        assert live == simulated, (version, live, simulated)
    # What the simulator dropped or aborted, the live side dropped too.
    simulated_drops = {d[1] for d in decisions if d[0] in ("drop", "abort")}
    assert simulated_drops <= out["dropped"]
    trained = {g for _, groups, _ in out["trained"] for g in groups}
    assert not trained & out["dropped"]


@pytest.mark.parametrize("name", ["libra", "areal"])
def test_the_replayed_jobs_drop_and_abort_stale_groups(name) -> None:
    """The tool-heavy workload's long tail makes some groups stale at η = 1 and 2: the agreement
    above covers both ways a group is lost (dropped when complete, aborted in flight)."""
    kinds = [d[0] for eta in (1, 2) for seed in (1, 2) for d in _record(name, eta, seed)[0]]
    assert kinds.count("drop") > 0 and kinds.count("abort") > 0


def test_a_step_takes_the_oldest_tokens_first_then_completion_order() -> None:
    assert training_order([("a", 3), ("b", 1), ("c", 3), ("d", None), ("e", 1)]) == ["b", "e", "a", "c", "d"]
    bound = StalenessBound(1)
    assert bound.launch_limit(2, groups_per_step=4, replaced=3) == 4 * 4 + 3
    assert bound.in_flight_limit(4) == 8
    assert not bound.is_stale(None, 10)
    assert bound.is_stale(1, 3) and not bound.is_stale(2, 3)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(-1)
