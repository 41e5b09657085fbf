import json

from services.policy.prefix_tree import (
    CausalPrefixTree,
    PrefixForest,
    ToolSignal,
    WindowStats,
    map_sandbox_status,
    size_class,
)

FAIL = ToolSignal("shell", "large", "failure")
OK = ToolSignal("shell", "small", "success")


def test_sandbox_status_mapping_is_total():
    assert map_sandbox_status("ok") == "success"
    assert map_sandbox_status("error") == "failure"
    assert map_sandbox_status("rejected") == "failure"
    assert map_sandbox_status("timeout") == "timeout"
    assert map_sandbox_status("killed") == "timeout"
    assert map_sandbox_status("something-new") == "failure"
    assert ToolSignal.from_sandbox("python", 10_000, "killed") == ToolSignal("python", "large", "timeout")


def test_size_class_thresholds():
    assert size_class(10) == "small"
    assert size_class(512) == "medium"
    assert size_class(4096) == "large"
    assert size_class(50, thresholds=(10, 100)) == "medium"


def test_window_stats_mean_p90_and_sliding():
    w = WindowStats(window=10)
    for v in range(1, 11):
        w.add(v)
    assert w.mean == 5.5
    assert w.p90 == 9
    w.add(100)  # evicts 1
    assert w.count == 10
    assert w.mean == (sum(range(2, 11)) + 100) / 10
    assert w.p90 == 10


def test_nodes_learn_remaining_tokens_along_the_path():
    tree = CausalPrefixTree()
    # total 1000 tokens; tool returns after 200 and 600 tokens
    tree.observe([OK, FAIL], [200, 600], 1000)
    assert tree.estimate([], min_count=1).mean == 1000
    e1 = tree.estimate([OK], min_count=1)
    assert (e1.mean, e1.depth) == (800, 1)
    e2 = tree.estimate([OK, FAIL], min_count=1)
    assert (e2.mean, e2.depth) == (400, 2)


def test_estimate_falls_back_to_deepest_trusted_prefix():
    tree = CausalPrefixTree()
    for _ in range(8):
        tree.observe([FAIL], [100], 5100)
    tree.observe([FAIL, OK], [100, 300], 400)
    est = tree.estimate([FAIL, OK], min_count=8)
    assert est.depth == 1
    assert est.count == 9
    assert tree.estimate([OK], min_count=8).depth == 0


def test_causal_signal_separates_outcomes():
    tree = CausalPrefixTree()
    for _ in range(20):
        tree.observe([FAIL], [500], 20_000)
        tree.observe([OK], [500], 800)
    assert tree.estimate([FAIL]).mean > 10 * tree.estimate([OK]).mean


def test_window_tracks_drift():
    tree = CausalPrefixTree(window=8)
    for _ in range(8):
        tree.observe([OK], [0], 1000)
    for _ in range(8):
        tree.observe([OK], [0], 5000)
    assert tree.estimate([OK]).mean == 5000


def test_forest_prefers_prompt_tree_and_falls_back_to_global():
    forest = PrefixForest(prompt_min_count=2)
    for i in range(10):
        forest.observe(f"p{i}", [OK], [100], 1100)
    forest.observe("hard", [OK], [100], 30_100)
    assert forest.estimate("hard", [OK]).source == "global"
    forest.observe("hard", [OK], [100], 30_100)
    est = forest.estimate("hard", [OK])
    assert est.source == "prompt" and est.mean == 30_000
    assert forest.estimate("unknown", [OK]).source == "global"


def test_forest_bounds_prompt_trees():
    forest = PrefixForest(max_prompts=3)
    for i in range(5):
        forest.observe(f"p{i}", [OK], [1], 10)
    assert list(forest.prompts) == ["p2", "p3", "p4"]


def test_round_trip_through_json():
    forest = PrefixForest()
    for i in range(12):
        forest.observe(f"p{i % 3}", [OK, FAIL], [100, 200], 1000 + i)
    data = json.loads(json.dumps(forest.to_dict()))
    again = PrefixForest.from_dict(data)
    for pid in ("p0", "p1", "unknown"):
        assert again.estimate(pid, [OK, FAIL]) == forest.estimate(pid, [OK, FAIL])
    assert again.global_tree.node_count() == forest.global_tree.node_count()


def test_a_routing_state_over_its_limit_keeps_the_most_recently_used_prompts():
    """`routing_memory.encode`: the saved state stays under Redis's bound on a value, leaving out
    the least recently used prompts' own trees (the shared tree always kept)."""
    from services.common.runconfig import RunConfig
    from services.policy.routing import build_router
    from services.scheduler.routing_memory import encode

    router = build_router(RunConfig().rollout.buckets, "cmlfq")
    for i in range(60):
        for k in range(4):
            router.core.forest.observe(f"p{i}", [OK, FAIL], [100 + k, 300 + k], 1000 + 7 * k + i)
    router.core.forest.observe("p0", [OK], [10], 500)  # p0 used last: the most recent
    whole, kept = encode(router, limit=10**9)
    assert kept == 60 and json.loads(whole) == json.loads(json.dumps(router.to_dict()))
    raw, kept = encode(router, limit=len(whole) // 3)
    assert 0 < kept < 60 and len(raw) <= len(whole) // 3
    again = build_router(RunConfig().rollout.buckets, "cmlfq")
    again.load_dict(json.loads(raw))
    assert list(again.core.forest.prompts) == list(router.core.forest.prompts)[60 - kept :]
    assert "p0" in again.core.forest.prompts and "p1" not in again.core.forest.prompts
    assert again.core.forest.global_tree.to_dict() == router.core.forest.global_tree.to_dict()
    raw, kept = encode(router, limit=len(json.dumps(router.to_dict(0), separators=(",", ":"))))
    assert kept == 0 and json.loads(raw)["forest"]["prompts"] == {}  # the shared tree alone fits
