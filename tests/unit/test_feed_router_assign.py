import pytest

from services.policy.assign import Slot, StaticAssigner
from services.scheduler.feed import TaskFeed
from services.scheduler.task import arithmetic_tasks


def test_feed_respects_staleness_budget() -> None:
    feed = TaskFeed(arithmetic_tasks(3, 0), groups_per_step=2, max_staleness=1, total_steps=3)
    first = feed.take(trained_version=0)
    assert len(first) == 4  # (0 + 1 + 1) steps x 2 groups
    assert feed.take(trained_version=0) == []
    assert len(feed.take(trained_version=1)) == 2
    assert len(feed.take(trained_version=5)) == 0  # capped by the job's total groups
    assert feed.exhausted
    assert [t.index for t in first] == [0, 1, 2, 3]
    assert first[3].task == first[0].task  # the feed cycles through the dataset


def test_feed_needs_tasks() -> None:
    with pytest.raises(ValueError):
        TaskFeed([], groups_per_step=1, max_staleness=0, total_steps=1)


def test_static_assigner_roles_and_buckets() -> None:
    a = StaticAssigner(["short", "long"])
    slots: dict[str, Slot] = {}
    for wid, kind, pref in [
        ("e0", "rollout-engine", ""),
        ("e1", "rollout-engine", ""),
        ("e2", "rollout-engine", "long"),
    ]:
        s = a.assign(wid, kind, pref, slots)
        assert s is not None
        slots[wid] = s
    assert [slots[w].bucket for w in ("e0", "e1", "e2")] == ["short", "long", "long"]
    t1 = a.assign("t1", "trainer", "", slots)
    assert t1 is not None and t1.role == "train"
    slots["t1"] = t1
    t2 = a.assign("t2", "trainer", "", slots)
    assert t2 is not None and t2.role == "standby"
    s1 = a.assign("s1", "scheduler", "", slots)
    assert s1 is not None and s1.role == "schedule"
    slots["s1"] = s1
    s2 = a.assign("s2", "scheduler", "", slots)
    assert s2 is not None and s2.role == "standby"  # one scheduler acts, the next stands by
    assert a.assign("x", "mystery", "", slots) is None


def test_engines_whose_tp_is_fixed_go_to_buckets_of_their_tp() -> None:
    """vLLM engines (their TP set when they start) serve only buckets of their TP, the emptiest
    first, a preferred bucket of another TP not taken; an engine of a TP no bucket has goes to the
    nearest. Without TPs to match (emulated, hf), any bucket."""
    a = StaticAssigner(
        ["short", "mid", "long"], {"short": 2, "mid": 1, "long": 1}, {"short": 1, "mid": 1, "long": 4}
    )
    slots: dict[str, Slot] = {}
    for wid, tp, pref in [
        ("a", 4, ""),
        ("b", 1, ""),
        ("c", 1, "long"),
        ("d", 1, ""),
        ("e", 8, ""),
        ("f", 2, ""),
    ]:
        s = a.assign(wid, "rollout-engine", pref, slots, tp=tp)
        assert s is not None and s.tensor_parallel == tp
        slots[wid] = s
    assert {w: s.bucket for w, s in slots.items()} == {
        "a": "long",
        "b": "short",
        "c": "mid",  # "long" is TP4: not for a TP1 engine
        "d": "short",
        "e": "long",  # TP8: the nearest is TP4
        "f": "short",  # TP2: TP1 and TP4 equally near; the emptiest of those for its share
    }
    free = StaticAssigner(["short", "long"], tps=None)
    s = free.assign("x", "rollout-engine", "long", {}, tp=1)
    assert s is not None and s.bucket == "long"


def test_feed_replaces_every_group_that_was_not_trained() -> None:
    feed = TaskFeed(arithmetic_tasks(5, 0), groups_per_step=2, max_staleness=0, total_steps=2)
    first = feed.take(trained_version=0)
    assert [t.index for t in first] == [0, 1] and feed.take(0) == []
    assert not feed.resolve(first[0].group_id, "trained")
    assert feed.resolve(first[1].group_id, "failed")  # replaced: a new group within the same budget
    assert not feed.resolve(first[1].group_id, "failed")  # an outcome counts once
    assert not feed.resolve("g99999-forged", "stale")  # and only for groups this feed launched
    again = feed.take(trained_version=0)
    assert [t.index for t in again] == [2] and again[0].group_id not in {t.group_id for t in first}
    assert feed.replaced == 1 and feed.total_groups == 5
    assert feed.outcomes == {"trained": 1, "failed": 1}
    step2 = feed.take(trained_version=1)
    assert len(step2) == 2 and feed.exhausted
    assert set(feed.outstanding) == {again[0].group_id} | {t.group_id for t in step2}


def test_turn_timeout_follows_the_token_budget_unless_set() -> None:
    from services.scheduler.config import SchedulerSettings

    derived = SchedulerSettings()
    assert derived.turn_timeout(40) == 60.0 + 0.25 * 40
    assert derived.turn_timeout(4096) > derived.turn_timeout(40)
    assert SchedulerSettings(turn_timeout_s=5.0).turn_timeout(4096) == 5.0
