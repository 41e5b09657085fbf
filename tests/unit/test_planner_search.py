import math

import pytest

from services.common.cost_model import CostModel, GPUSpec, ModelSpec
from services.policy.search import (
    BucketPlan,
    ClusterSpec,
    Plan,
    SearchOptions,
    WorkloadStats,
    _splits,
    best_layout,
    evaluate,
    rollout_time,
    search,
    train_time,
)

GPU = GPUSpec("A800", flops=312e12, mem_bw=2.039e12, mem_bytes=80e9)
TINY = ModelSpec("tiny", 0.5e9, 0.5e9, layers=24, hidden=1024, kv_heads=4, head_dim=64)
CM = CostModel(GPU, TINY)


def stats(n_traj: int, lengths: list[float]) -> WorkloadStats:
    return WorkloadStats(n_traj, lengths, mean_turns=2, mean_tool_s=0.5, prompt_tokens=500)


def brute_force(n: int, st: WorkloadStats, opts: SearchOptions, step: int) -> float:
    """Every training size on the search's grid (multiples of the largest bucket TP)."""
    best = math.inf
    for tg in range(step, n, step):
        buckets, t_roll = best_layout(CM, st, n - tg, opts)
        if buckets:
            tp = min(
                (t for t in opts.train_tps if tg % t == 0), key=lambda t: train_time(CM, st, tg, t, opts)
            )
            best = min(best, max(train_time(CM, st, tg, tp, opts), t_roll))
    return best


def test_splits_enumerates_every_composition():
    got = _splits(4, 3)
    assert len(got) == math.comb(4 + 2, 2) and len(set(got)) == len(got)
    assert all(sum(s) == 4 for s in got)


def test_single_bucket_layout_takes_every_rollout_gpu():
    opts = SearchOptions(bucket_tps=(2,), bucket_names=("all",))
    buckets, t = best_layout(CM, stats(64, [1000.0] * 20), 8, opts)
    assert [(b.tp, b.replicas) for b in buckets] == [(2, 4)] and t > 0


def test_search_puts_gpus_where_the_bottleneck_is():
    st = stats(1024, [1000.0, 3000.0] * 10)
    train = []
    for scale in (0.01, 1.0, 100.0):
        opts = SearchOptions(
            bucket_tps=(1,), bucket_names=("all",), hybrid=False, train_tps=(1,), train_scale=scale
        )
        plan = search(ClusterSpec(8, GPU), TINY, st, CM, opts)
        assert plan.total_gpus == 8
        train.append(plan.train_gpus)
    assert train[0] == 1  # training is nearly free: the memory minimum trains
    assert train[2] == 7  # training dominates: all but the one rollout replica train
    assert train[0] <= train[1] <= train[2]


def test_search_matches_brute_force_on_a_small_cluster():
    st = stats(512, [300.0, 800.0, 1500.0, 4000.0, 12_000.0] * 4)
    opts = SearchOptions(bucket_tps=(1, 2), bucket_names=("short", "long"), hybrid=False, train_tps=(1, 2))
    plan = search(ClusterSpec(8, GPU), TINY, st, CM, opts)
    assert plan.step_time == pytest.approx(brute_force(8, st, opts, step=2))
    assert plan.total_gpus == 8
    assert all(b.replicas >= 1 for b in plan.buckets)
    assert plan.buckets[-1].max_tokens == math.inf


def test_fixed_train_gpus_is_respected_and_infeasible_clusters_raise():
    st = stats(64, [1000.0] * 10)
    opts = SearchOptions(bucket_tps=(1,), bucket_names=("all",), fixed_train_gpus=3, hybrid=False)
    assert search(ClusterSpec(8, GPU), TINY, st, CM, opts).train_gpus == 3
    with pytest.raises(ValueError):
        search(ClusterSpec(2, GPU), TINY, st, CM, SearchOptions())  # three buckets cannot fit


def test_more_rollout_gpus_never_slow_rollout_down():
    st = stats(512, [500.0, 2000.0, 9000.0] * 5)
    b = [BucketPlan("all", 1, r, math.inf) for r in (2, 4, 8)]
    times = [rollout_time(CM, st, [x], SearchOptions()) for x in b]
    assert times[0] >= times[1] >= times[2]


def test_plan_round_trips_and_evaluate_repredicts_under_new_stats():
    st = stats(256, [500.0, 2000.0, 9000.0] * 5)
    plan = search(ClusterSpec(16, GPU), TINY, st, CM, SearchOptions(hybrid=False))
    again = Plan.from_dict(plan.to_dict())
    assert again.to_dict() == plan.to_dict()
    longer = stats(256, [x * 2 for x in [500.0, 2000.0, 9000.0] * 5])
    assert evaluate(CM, longer, plan).t_rollout > evaluate(CM, st, plan).t_rollout
