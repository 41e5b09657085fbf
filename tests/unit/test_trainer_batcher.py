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
