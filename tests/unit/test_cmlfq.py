import math

import pytest

from services.policy.cmlfq import CMLFQ, Bucket, CMLFQConfig, EngineView
from services.policy.prefix_tree import ToolSignal

FAIL = ToolSignal("shell", "large", "failure")
OK = ToolSignal("shell", "small", "success")
BUCKETS = [Bucket("short", 1, 2000, 1.0), Bucket("medium", 2, 8000, 0.6), Bucket("long", 4, math.inf, 0.35)]


def make(**kw) -> CMLFQ:
    return CMLFQ(CMLFQConfig(list(BUCKETS), **kw))


def teach(q: CMLFQ, signal: ToolSignal, total: int, n: int = 10, at: int = 500) -> None:
    for i in range(n):
        tid = f"teach-{signal.key}-{total}-{i}"
        q.admit(tid, f"other{i}", 0.0)
        q.on_tool_return(tid, signal, at, 1000, 0.0)
        q.finish(tid, total, 0.0)


def test_new_trajectory_starts_in_shortest_bucket():
    assert make().admit("t", "p", 0.0) == "short"


def test_without_tree_data_classic_mlfq_demotes_by_attained_service():
    q = make()
    q.admit("t", "p", 0.0)
    d = q.on_tool_return("t", OK, 1500, 2000, 1.0)
    assert (d.bucket, d.migrate) == ("short", False)
    d = q.on_tool_return("t", OK, 2500, 3000, 2.0)
    assert (d.bucket, d.migrate, d.reason) == ("medium", True, "demote:attained")


def test_classic_mlfq_ablation_ignores_the_tree():
    q = make(use_tree=False)
    teach(q, FAIL, 20_000)
    q.admit("t", "p", 0.0)
    assert not q.on_tool_return("t", FAIL, 500, 1000, 1.0).migrate


def test_confident_prediction_migrates_long_trajectory_early():
    q = make()
    teach(q, FAIL, 20_000)
    q.admit("t", "p", 0.0)
    d = q.on_tool_return("t", FAIL, 500, 1000, 1.0)
    assert d.migrate and d.bucket == "long" and d.reason == "demote:predicted"
    assert q.bucket_of("t") == "long"


def test_short_prediction_keeps_trajectory_in_place():
    q = make()
    teach(q, OK, 900)
    q.admit("t", "p", 0.0)
    d = q.on_tool_return("t", OK, 500, 1000, 1.0)
    assert not d.migrate and d.reason == "stay:predicted"


def test_mean_and_p90_disagreeing_does_not_migrate():
    q = make()
    # remaining: mostly short, a heavy tail -> mean stays in short, P90 points at long
    teach(q, OK, 600, n=17, at=100)
    teach(q, OK, 9100, n=3, at=100)
    q.admit("t", "p", 0.0)
    d = q.on_tool_return("t", OK, 100, 1000, 1.0)
    assert d.estimate is not None and d.estimate.mean + 100 < 2000 < d.estimate.p90
    assert not d.migrate and d.reason == "stay:uncertain"


def test_migration_that_does_not_repay_reprefill_is_refused():
    q = make(prefill_cost=1.0)
    teach(q, FAIL, 4_000, at=500)
    q.admit("t", "p", 0.0)
    # predicted total 4000 -> medium; 3500 tokens left saves 3500*0.4 = 1400 < 5000*1*0.6 re-prefill
    d = q.on_tool_return("t", FAIL, 500, 5000, 1.0)
    assert not d.migrate and d.reason == "stay:not-worth"


def test_finish_teaches_the_tree_for_later_siblings():
    q = make(min_samples=1)
    q.admit("a", "p", 0.0)
    q.on_tool_return("a", FAIL, 100, 500, 1.0)
    q.finish("a", 25_000, 2.0)
    q.admit("b", "p", 3.0)
    assert q.on_tool_return("b", FAIL, 100, 500, 4.0).bucket == "long"


def test_queue_serves_the_earliest_admitted_trajectory_first():
    q = make()
    for tid, admitted in (("late", 5.0), ("early", 1.0), ("mid", 3.0)):
        q.admit(tid, "p", admitted)
        q.enqueue(tid, 10.0)
    assert [q.dequeue("short", 11.0) for _ in range(4)] == ["early", "mid", "late", None]


def test_classic_order_is_by_attained_service():
    q = make(aging_tokens_per_s=0.0, queue_order="attained")
    for tid, tokens in (("a", 1500), ("b", 100), ("c", 800)):
        q.admit(tid, "p", 0.0)
        q.on_turn_done(tid, tokens, 0.0)
        q.enqueue(tid, 0.0)
    assert q.queued("short") == 3
    assert [q.dequeue("short", 1.0) for _ in range(4)] == ["b", "c", "a", None]


def test_aging_prevents_starvation_within_a_bucket():
    q = make(aging_tokens_per_s=10.0, queue_order="attained")
    q.admit("old", "p", 0.0)
    q.on_turn_done("old", 1900, 0.0)
    q.enqueue("old", 0.0)
    # a stream of fresh short work arrives later; after ~190 s the old turn outranks it
    for i in range(30):
        now = 10.0 * (i + 1)
        q.admit(f"n{i}", "p", now)
        q.enqueue(f"n{i}", now)
    order = [q.dequeue("short", 400.0) for _ in range(31)]
    assert order.index("old") < 30
    assert order.index("old") <= 20


def test_aged_turn_is_served_by_idle_neighbour_bucket():
    q = make(aging_s=30.0)
    q.admit("t", "p", 0.0)
    q.enqueue("t", 0.0)
    assert q.dequeue("medium", 10.0) is None
    assert q.dequeue("medium", 40.0) == "t"
    assert q.bucket_of("t") == "medium"
    assert q.queued() == 0


def test_pick_engine_prefers_context_affinity_then_load():
    q = make(affinity_weight=0.3)
    q.admit("t", "p", 0.0)
    engines = [EngineView("e0", 4, 16), EngineView("e1", 2, 16), EngineView("e2", 16, 16)]
    assert q.pick_engine("short", engines, "t") == "e1"
    engines = [EngineView("e0", 3, 16), EngineView("e1", 6, 16)]
    assert q.pick_engine("short", engines, "t") == "e1"  # holds the context: 6/16 - 0.3 < 3/16
    engines = [EngineView("e0", 1, 16), EngineView("e1", 12, 16)]
    assert q.pick_engine("short", engines, "t") == "e0"  # affinity does not beat a large load gap
    assert q.pick_engine("short", [EngineView("e9", 16, 16)], "t") is None


def test_drop_and_finish_release_queue_slots():
    q = make()
    q.admit("a", "p", 0.0)
    q.admit("b", "p", 0.0)
    q.enqueue("a", 0.0)
    q.enqueue("b", 0.0)
    q.drop("a")
    q.finish("b", 10, 1.0)
    assert q.queued() == 0
    assert q.dequeue("short", 2.0) is None


def test_persisted_trees_reload():
    q = make()
    teach(q, FAIL, 20_000)
    r = make()
    r.load_dict(q.to_dict())
    r.admit("t", "p", 0.0)
    assert r.on_tool_return("t", FAIL, 500, 1000, 1.0).bucket == "long"


def test_needs_buckets():
    with pytest.raises(ValueError):
        CMLFQ(CMLFQConfig([]))


def test_aged_turn_is_stolen_by_an_idle_bucket_that_is_not_adjacent():
    q = make(aging_s=30.0)
    q.admit("t", "p", 0.0)
    q.enqueue("t", 0.0)
    assert q.dequeue("long", 10.0) is None
    assert q.dequeue("long", 40.0) == "t"
    assert q.bucket_of("t") == "long" and q.queued() == 0


def test_replanned_thresholds_route_the_next_decision_and_keep_names_and_order():
    q = make(use_tree=False)
    q.admit("t", "p", 0.0)
    assert q.on_tool_return("t", OK, 2500, 3000, 1.0).bucket == "medium"
    assert q.set_thresholds({"short": 4000.0, "medium": 9000.0})
    assert [(b.name, b.max_tokens) for b in q.buckets] == [
        ("short", 4000),
        ("medium", 9000),
        ("long", math.inf),
    ]
    assert not q.set_thresholds({"short": 4000.0}), "nothing changed"
    q.admit("u", "p", 2.0)
    assert q.on_tool_return("u", OK, 2500, 3000, 3.0).bucket == "short", "2500 tokens fit the new short"
