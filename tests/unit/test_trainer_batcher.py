"""Group collection: only complete groups are trained; a stale member drops its whole group."""

from __future__ import annotations

from services.common.contracts import ev
from services.trainer.batcher import GroupBuffer


def member(group: str, i: int, version: int = 0, size: int = 2) -> ev.CompletedTrajectory:
    return ev.CompletedTrajectory(
        trajectory_id=f"{group}-{i}",
        group_id=group,
        sample_index=i,
        group_size=size,
        min_policy_version=version,
    )


def test_only_complete_groups_are_taken() -> None:
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=1)
    buf.add(member("a", 0), "h", 0)
    buf.add(member("b", 0), "h", 0)
    buf.add(member("a", 1), "h", 0)
    assert buf.take(2, 0) == ([], [])
    groups, _ = buf.take(1, 0)
    assert [p.traj.trajectory_id for p in groups[0]] == ["a-0", "a-1"]
    assert len(buf) == 1


def test_redelivery_adds_a_handle_instead_of_a_member() -> None:
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=1)
    assert buf.add(member("a", 0), "first", 0).outcome == "buffered"
    assert buf.add(member("a", 0), "second", 0).outcome == "redelivered"
    buf.add(member("a", 1), "x", 0)
    groups, _ = buf.take(1, 0)
    assert groups[0][0].handles == ["first", "second"]


def test_stale_member_drops_its_group_now_and_later() -> None:
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=1)
    buf.add(member("a", 0, version=3), "h0", 3)
    adm = buf.add(member("a", 1, version=1), "h1", 3)
    assert adm.outcome == "stale"
    assert {p.traj.trajectory_id for p in adm.released} == {"a-0", "a-1"}
    assert buf.add(member("a", 2, version=3, size=3), "h2", 3).outcome == "stale"
    assert len(buf) == 0


def test_complete_group_that_ages_while_waiting_is_dropped() -> None:
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=0)
    buf.add(member("a", 0, version=1), "h", 1)
    buf.add(member("a", 1, version=1), "h", 1)
    groups, stale = buf.take(2, 2)
    assert groups == [] and len(stale) == 2


def scored(group: str, rewards: list[float]) -> list[ev.CompletedTrajectory]:
    out = []
    for i, r in enumerate(rewards):
        t = member(group, i, size=len(rewards))
        t.reward = r
        out.append(t)
    return out


def test_zero_advantage_groups_are_filtered_within_the_budget_oldest_first() -> None:
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=1)
    for t in scored("flat0", [0.0, 0.0]) + scored("mixed", [0.0, 1.0]) + scored("flat1", [1.1, 1.1]):
        buf.add(t, "h", 0)
    buf.add(scored("partial", [0.0, 0.0])[0], "h", 0)  # incomplete: its last member may differ
    filtered = buf.filter_uninformative(1)
    assert [[p.traj.trajectory_id for p in g] for g in filtered] == [["flat0-0", "flat0-1"]]
    # past the budget the other flat group stays and is taken like any complete group
    assert buf.filter_uninformative(0) == []
    groups, _ = buf.take(2, 0)
    assert [g[0].traj.group_id for g in groups] == ["mixed", "flat1"]
    # a filtered group is dropped for good: a late redelivery of a member is released at once
    adm = buf.add(scored("flat0", [0.0, 0.0])[0], "again", 0)
    assert adm.outcome == "stale" and [p.handles for p in adm.released] == [["again"]]
    assert [g[0].traj.group_id for g in buf.filter_uninformative(5)] == []
    assert len(buf) == 1  # the partial group waits


def test_a_step_takes_the_group_with_the_oldest_tokens_first() -> None:
    """A group nearest the staleness bound trains before it goes stale; equal ages train in the
    order they completed, whatever order their members arrived in."""
    buf: GroupBuffer[str] = GroupBuffer(max_staleness=2)
    buf.add(member("late", 0, version=1), "h", 2)
    buf.add(member("fresh", 0, version=2), "h", 2)
    buf.add(member("fresh", 1, version=2), "h", 2)
    buf.add(member("old", 0, version=1), "h", 2)
    buf.add(member("old", 1, version=1), "h", 2)
    buf.add(member("late", 1, version=1), "h", 2)
    groups, stale = buf.take(3, 2)
    assert [g[0].traj.group_id for g in groups] == ["old", "late", "fresh"]
    assert stale == []
