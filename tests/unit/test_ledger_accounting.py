"""Where every trajectory handed to the trainer ended up: trained, dropped with its group, open at
the end of the job, or lost."""

from __future__ import annotations

from services.scheduler.feed import GroupTicket, group_of
from services.scheduler.ledger import account
from services.scheduler.task import Task


def _ids(group: str, n: int = 2) -> list[str]:
    ticket = GroupTicket(group, Task("p", "1+1", 2), 0)
    return [ticket.trajectory_id(i) for i in range(n)]


def test_trajectory_ids_name_their_group() -> None:
    assert {group_of(t) for t in _ids("g00003-p7-s1x")} == {"g00003-p7-s1x"}


def test_every_published_trajectory_is_accounted_for() -> None:
    trained, stale, failed, running = _ids("g1"), _ids("g2"), _ids("g3"), _ids("g4")
    filtered = _ids("g5")  # zero advantage: dropped before collation, replaced by the feed
    acc = account(
        set(trained + stale + failed + running + filtered),
        set(trained),
        {"g1": "trained", "g2": "stale", "g3": "failed", "g5": "filtered"},
        {"g4"},
    )
    assert (acc.published, acc.trained, acc.dropped, acc.open_at_end, acc.lost) == (10, 2, 6, 2, [])


def test_a_trained_group_missing_a_member_or_an_unknown_group_is_lost() -> None:
    g1, g5 = _ids("g1"), _ids("g5")
    acc = account(set(g1 + g5), {g1[0]}, {"g1": "trained"}, set())
    assert acc.lost == sorted([g1[1], *g5])
    assert acc.trained == 1


def test_trained_before_the_scheduler_heard_the_outcome_counts_as_trained() -> None:
    g = _ids("g1")
    acc = account(set(g), set(g), {}, {"g1"})
    assert (acc.trained, acc.open_at_end, acc.lost) == (2, 0, [])
