"""Placement through the load indexes (pure): the engine a policy picks from two indexed candidates
is the one it picks scanning every engine, whatever the engines, loads, free KV and avoided
engines; and the index itself."""

from __future__ import annotations

import random

import pytest

from services.common.runconfig import BucketConfig
from services.policy.dispatch import Dispatcher, build_dispatcher
from services.policy.placement import LoadIndex, candidates
from services.policy.prefix_tree import ToolSignal
from tools.bench.control_plane import ScanningDispatcher

THREE = [
    BucketConfig(name="short", tensor_parallel=1, max_output_tokens=64),
    BucketConfig(name="mid", tensor_parallel=2, max_output_tokens=512),
    BucketConfig(name="long", tensor_parallel=4),
]


def test_the_index_gives_the_least_loaded_engine_with_a_free_slot_first_in_order_on_a_tie() -> None:
    index = LoadIndex()
    index.set("a", 2, 1, 4)
    index.set("b", 1, 1, 4)
    index.set("c", 3, 0, 2)
    assert index.least(lambda _: True) == "c"
    index.set("c", 3, 2, 2)  # full: out of the index
    assert "c" not in index and len(index) == 2
    assert index.least(lambda _: True) == "b", "a tie goes to the lower order"
    assert index.least(lambda e: e != "b") == "a"
    assert index.least(lambda _: False) is None
    assert index.least(lambda _: True) == "b", "what a search passed over stays indexed"
    index.remove("b")
    assert index.least(lambda _: True) == "a"
    for load in range(1000):  # replaced entries do not pile up
        index.set("a", 2, load % 4, 4)
    assert len(index._heap) <= 2 * len(index) + 64


def test_candidates_are_the_least_loaded_and_the_holder_in_engine_order() -> None:
    order = {"x": 2, "y": 1}.__getitem__
    assert candidates("x", "y", order) == ["y", "x"]
    assert candidates("x", "x", order) == ["x"]
    assert candidates(None, "y", order) == ["y"] and candidates(None, None, order) == []


def _scanning(policy: str) -> Dispatcher:
    d = build_dispatcher(THREE, policy, 4)
    return ScanningDispatcher(d.router, d.default_capacity, d.pool)


@pytest.mark.parametrize("policy", ["cmlfq", "least_loaded"])
@pytest.mark.parametrize("seed", range(6))
def test_indexed_placement_decides_what_a_scan_of_every_engine_decides(policy: str, seed: int) -> None:
    """Two dispatchers, one placing through the indexes and one scanning, driven by the same random
    plan changes, load reports (capacity, free KV), turns placed (some avoiding an engine), turns
    ended, slots handed to waiting turns and tool returns: every decision is the same, and the
    engines a scheduler tick drains are those with a free slot while a turn waits."""
    rng = random.Random(seed)
    indexed, scanning = build_dispatcher(THREE, policy, 4), _scanning(policy)
    both = (indexed, scanning)
    engines = [f"e{i}" for i in range(12)]
    running: dict[str, str] = {}  # trajectory -> engine running its turn
    waiting: set[str] = set()
    admitted = 0
    now = 0.0

    def plan() -> None:
        kept = rng.sample(engines, rng.randint(1, len(engines)))
        layout = {wid: rng.choice(["short", "mid", "long"]) for wid in kept}
        for d in both:
            d.set_engines(layout)
        for traj, wid in list(running.items()):
            if wid not in layout:
                del running[traj]

    plan()
    for _ in range(1500):
        now += 0.1
        op = rng.random()
        if op < 0.03:
            plan()
        elif op < 0.25:
            traj = f"t{admitted}"
            admitted += 1
            assert len({d.admit(traj, f"p{admitted % 5}", now) for d in both}) == 1
            waiting.add(traj)
        elif op < 0.55 and waiting:
            traj = rng.choice(sorted(waiting - set(indexed.queued)) or sorted(waiting))
            avoid = rng.choice([None, None, *indexed.engines, *engines])  # some no longer serving
            need = rng.choice([0, 100, 1000, 5000])
            picks = {d.place(traj, now, avoid, need) for d in both}
            assert len(picks) == 1, (traj, avoid, need, picks)
            pick = picks.pop()
            if pick is not None:
                waiting.discard(traj)
                running[traj] = pick
        elif op < 0.7:
            wid = rng.choice(engines)
            capacity, free_kv = rng.randint(1, 6), rng.choice([-1, 0, 500, 2000, 10000])
            for d in both:
                d.set_capacity(wid, capacity, free_kv)
        elif op < 0.85 and running:
            traj = rng.choice(sorted(running))
            wid = running.pop(traj)
            for d in both:
                d.release(wid)
            tokens = rng.randint(1, 2000)
            if rng.random() < 0.5:
                signal = ToolSignal("python", rng.choice(["small", "large"]), "success")
                decisions = {d.tool_return(traj, signal, tokens, 1000, now).bucket for d in both}
                assert len(decisions) == 1
                waiting.add(traj)
            else:
                for d in both:
                    d.finish(traj, tokens, now, failed=False)
        else:
            wid = rng.choice(engines)
            given = {d.next_for(wid, now) for d in both}
            assert len(given) == 1, (wid, given)
            traj = given.pop()
            if traj is not None:
                waiting.discard(traj)
                running[traj] = wid
        assert {w: (e.in_flight, e.bucket) for w, e in indexed.engines.items()} == {
            w: (e.in_flight, e.bucket) for w, e in scanning.engines.items()
        }
        # a tick drains exactly the engines a turn could be given to: with a free slot, in order
        free = sorted((e.order, w) for w, e in indexed.engines.items() if e.free > 0)
        assert indexed.free_engines() == ([w for _, w in free] if indexed.queued else [])
    assert indexed.decisions == scanning.decisions > 500
    assert indexed.migrations == scanning.migrations
