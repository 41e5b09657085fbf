"""The live scheduler's queues and routing decisions (pure): capacity, C-MLFQ moves, the baseline."""

from __future__ import annotations

import pytest

from services.common.runconfig import BucketConfig, RunConfig
from services.policy.dispatch import Dispatcher, build_dispatcher
from services.policy.prefix_tree import ToolSignal
from services.policy.routing import build_router

TWO = [
    BucketConfig(name="short", tensor_parallel=1, max_output_tokens=64),
    BucketConfig(name="long", tensor_parallel=4),
]
OK = ToolSignal("python", "small", "success")


def _two_buckets(policy: str = "cmlfq", capacity: int = 1) -> Dispatcher:
    d = build_dispatcher(TWO, policy, capacity)
    d.set_engines({"e-short": "short", "e-long": "long"})
    return d


def test_turns_beyond_an_engines_capacity_wait_and_take_the_slot_that_frees() -> None:
    d = _two_buckets()
    for t in ("a", "b"):
        assert d.admit(t, "p", 0.0) == "short"
    assert d.place("a", 0.0) == "e-short"
    assert d.place("b", 0.0) is None and set(d.queued) == {"b"}
    assert d.queued_by_bucket() == {"short": 1}
    assert d.next_for("e-short", 1.0) is None, "no free slot yet"
    d.release("e-short")
    assert d.next_for("e-short", 1.0) == "b" and not d.queued
    assert d.engines["e-short"].in_flight == 1 and d.migrations == 0


@pytest.mark.parametrize("policy", ["cmlfq", "least_loaded"])
def test_a_turn_with_alternatives_takes_a_slot_for_each_sequence(policy: str) -> None:
    """An agent's call with n = 3 runs three sequences on its engine: it takes three slots, waits
    while fewer are free (unless the engine runs nothing), and frees all three."""
    d = build_dispatcher(TWO, policy, 4)
    d.set_engines({"e1": "short", "e2": "short"})
    for t in ("a", "b", "c", "big"):
        d.admit(t, "p", 0.0)
    assert d.place("a", 0.0, seqs=3) == "e1"
    assert d.engines["e1"].in_flight == 3
    assert d.place("b", 0.0, seqs=3) == "e2"  # e1 has one slot left: not enough
    assert d.place("c", 0.0, seqs=2) is None and d.seqs == {"c": 2}  # 1 + 1 free: it waits
    assert d.next_for("e1", 1.0) is None and "c" in d.queued  # one free slot is not two
    d.release("e1", 3)
    assert d.next_for("e1", 1.0) == "c" and d.engines["e1"].in_flight == 2 and not d.seqs
    d.release("e2", 3)
    assert d.place("big", 1.0, seqs=8) == "e2"  # more than a batch: only where nothing runs
    assert d.engines["e2"].in_flight == 8 and d.engines["e2"].free < 0
    d.release("e2", 8)
    assert d.engines["e2"].in_flight == 0


def test_a_tool_return_past_the_bucket_budget_moves_the_trajectory_to_the_long_bucket() -> None:
    d = _two_buckets(capacity=4)
    d.admit("a", "p", 0.0)
    assert d.place("a", 0.0) == "e-short"
    d.release("e-short")
    decision = d.tool_return("a", OK, 100, 300, 1.0)
    assert decision.migrate and decision.bucket == "long" and decision.reason == "demote:attained"
    assert d.bucket_of("a") == "long" and d.migrations == 1
    assert d.place("a", 1.0) == "e-long"


def test_an_idle_bucket_steals_an_aged_turn_and_the_move_counts() -> None:
    d = _two_buckets()
    for t in ("a", "b"):
        d.admit(t, "p", 0.0)
    assert d.place("a", 0.0) == "e-short"
    d.release("e-short")
    d.tool_return("a", OK, 100, 300, 1.0)  # a moves to long
    assert d.place("a", 1.0) == "e-long"
    d.admit("c", "p", 1.0)
    d.tool_return("c", OK, 200, 300, 1.0)
    assert d.place("c", 1.0) is None  # long is full: c waits there
    assert d.place("b", 1.0) == "e-short"
    d.release("e-short")
    assert d.next_for("e-short", 2.0) is None, "too young to steal"
    migrations = d.migrations
    assert d.next_for("e-short", 60.0) == "c"
    assert d.bucket_of("c") == "short" and d.migrations == migrations + 1


def test_the_least_loaded_baseline_pools_every_engine_and_never_moves() -> None:
    d = _two_buckets("least_loaded")
    for t in ("a", "b", "c"):
        d.admit(t, "p", 0.0)
    assert {d.place("a", 0.0), d.place("b", 0.0)} == {"e-short", "e-long"}
    assert d.place("c", 0.0) is None
    assert not d.tool_return("a", OK, 10_000, 300, 1.0).migrate and d.migrations == 0
    d.release("e-long")
    assert d.next_for("e-long", 1.0) == "c"


def test_what_cmlfq_learned_survives_a_restart() -> None:
    first = build_router(TWO, "cmlfq")
    for i in range(12):
        t = f"t{i}"
        first.admit(t, "p", 0.0, 0)
        first.on_tool_return(t, OK, 10, 100, 1.0)
        first.finish(t, 500, 2.0)
    second = build_router(TWO, "cmlfq")
    second.load_dict(first.to_dict())
    second.admit("new", "p", 3.0, 0)
    decision = second.on_tool_return("new", OK, 10, 100, 3.0)
    assert decision.estimate is not None and decision.estimate.mean == pytest.approx(490)
    assert decision.bucket == "long" and decision.reason == "demote:predicted"


@pytest.mark.parametrize(
    "buckets, error",
    [
        ([{"name": "a"}, {"name": "b"}], "every bucket but the last needs max_output_tokens"),
        (
            [{"name": "a", "max_output_tokens": 100}, {"name": "b", "max_output_tokens": 50}],
            "must grow",
        ),
        ([{"name": "a", "max_output_tokens": 10}, {"name": "a"}], "unique"),
    ],
)
def test_bucket_configs_that_cmlfq_cannot_use_are_refused(buckets: list[dict], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RunConfig.model_validate({"rollout": {"engines": 2, "buckets": buckets}})


def test_a_turn_goes_only_to_an_engine_whose_free_kv_holds_it() -> None:
    """Load reports carry each engine's free KV: a turn that would not fit there counts the engine
    as full (it would preempt another sequence), so it goes to one where it fits or waits; what
    was sent since the report counts against it; an engine running nothing takes any turn."""
    d = build_dispatcher([BucketConfig(name="all")], "cmlfq", 4)
    d.set_engines({"e-a": "all", "e-b": "all"})
    d.set_capacity("e-a", 4, free_kv_tokens=1000)
    d.set_capacity("e-b", 4, free_kv_tokens=5000)
    for t in ("a", "b", "c", "d"):
        d.admit(t, "p", 0.0)
    assert d.place("a", 0.0, need_tokens=3000) == "e-b", "e-a is the less loaded, but 3000 do not fit there"
    assert d.engines["e-b"].free_kv == 2000
    assert d.place("b", 0.0, need_tokens=800) in ("e-a", "e-b")
    # neither holds 4000 now: it waits, though both have free slots
    assert d.place("c", 0.0, need_tokens=4000) is None and "c" in d.queued
    assert d.next_for("e-b", 1.0) is None and "c" in d.queued, "e-b runs turns and its KV is full"
    # an engine running nothing takes it: the one way it ever runs
    d.set_engines({"e-a": "all", "e-b": "all", "e-c": "all"})
    d.set_capacity("e-c", 4, free_kv_tokens=100)
    assert d.next_for("e-c", 2.0) == "c" and not d.queued
    # a report resets the estimate; an engine that cannot tell (-1, hf) takes what its slots allow
    d.set_capacity("e-a", 4, free_kv_tokens=-1)
    assert d.place("d", 2.0, need_tokens=10**9) == "e-a"


def test_a_queued_turn_an_engine_answered_wrongly_waits_for_another_engine_of_its_bucket() -> None:
    """A turn retried away from an engine whose answer was refused (`avoid`) and queued is passed
    over by that engine's free slots while another engine of its bucket serves, and taken by the
    other; an engine alone in its bucket still takes it (no turn waits for an engine that is not
    there)."""
    d = build_dispatcher(TWO, "cmlfq", 1)
    d.set_engines({"bad": "short", "good": "short", "e-long": "long"})
    for t in ("a", "b", "c"):
        d.admit(t, "p", 0.0)
    assert {d.place("a", 0.0), d.place("b", 0.0)} == {"bad", "good"}
    assert d.place("c", 0.0, avoid="bad") is None  # both busy: c waits, bad's answer refused
    d.release("bad")
    assert d.next_for("bad", 1.0) is None and d.queued == {"c": "short"}, "bad passes c over"
    d.release("good")
    assert d.next_for("good", 1.0) == "c" and not d.queued and not d.avoiding
    alone = build_dispatcher(TWO, "cmlfq", 1)
    alone.set_engines({"only": "short"})
    for t in ("x", "y"):
        alone.admit(t, "p", 0.0)
    assert alone.place("x", 0.0) == "only"
    assert alone.place("y", 0.0, avoid="only") is None
    alone.release("only")
    assert alone.next_for("only", 1.0) == "y", "the only engine there is"
    alone.finish("y", 4, 2.0, failed=False)
    assert not alone.avoiding
