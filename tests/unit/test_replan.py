import itertools
import math
import random

import pytest

from services.common.cost_model import load_presets
from services.policy.replan import (
    REFIT_QUANTILES,
    EnginePool,
    ReplanPolicy,
    ReplanSignals,
    assign_layout,
    by_id,
    length_sample,
    refit_layout,
    refit_thresholds,
)
from services.policy.search import BucketPlan, SearchOptions, WorkloadStats, rollout_time

STEADY = ReplanSignals(queue_pressure=0.5, rejected=0, rollout_train_ratio=1.0)


def test_first_call_fires_on_interval_then_cooldown_blocks_every_trigger():
    p = ReplanPolicy(interval_s=600, cooldown_s=120)
    assert p.should_replan(0.0, STEADY) == (True, "interval")
    p.accept(0.0, 100.0, 100.0, 0.0)
    hot = ReplanSignals(queue_pressure=10.0, rejected=5, rollout_train_ratio=3.0)
    assert p.should_replan(60.0, hot) == (False, "cooldown")
    assert p.should_replan(130.0, hot)[0]


def test_each_trigger_fires_after_cooldown():
    p = ReplanPolicy(interval_s=600, cooldown_s=120, last_replan=0.0)
    assert p.should_replan(200.0, STEADY) == (False, "steady")
    assert p.should_replan(200.0, ReplanSignals(queue_pressure=2.5)) == (True, "queue_pressure")
    assert p.should_replan(200.0, ReplanSignals(rejected=1)) == (True, "rejected")
    assert p.should_replan(200.0, ReplanSignals(rollout_train_ratio=1.5)) == (True, "imbalance")
    assert p.should_replan(200.0, ReplanSignals(rollout_train_ratio=0.5)) == (True, "imbalance")
    assert p.should_replan(700.0, STEADY) == (True, "interval")


def test_accept_requires_gain_over_horizon_to_beat_reconfiguration_cost():
    p = ReplanPolicy(horizon_steps=5, min_gain=0.03)
    assert p.accept(0.0, current_step_s=100.0, new_step_s=90.0, reconfig_s=40.0)  # 10 s x 5 > 40 s
    assert not p.accept(0.0, current_step_s=100.0, new_step_s=90.0, reconfig_s=60.0)  # 50 s < 60 s


def test_marginal_or_negative_gains_are_rejected_but_still_start_the_cooldown():
    p = ReplanPolicy(min_gain=0.03, cooldown_s=120)
    assert not p.accept(50.0, current_step_s=100.0, new_step_s=98.0, reconfig_s=0.0)
    assert not p.accept(50.0, current_step_s=100.0, new_step_s=120.0, reconfig_s=0.0)
    assert p.last_replan == 50.0
    assert p.should_replan(100.0, ReplanSignals(queue_pressure=99.0)) == (False, "cooldown")


def test_refit_moves_the_threshold_to_where_the_lengths_are_and_never_predicts_worse():
    """Short outputs mostly near 2k tokens and a tail near 30k: a threshold set for a different
    workload (500 tokens) sends everything to the TP2 bucket; the refit puts it among the new
    quantiles and predicts a shorter rollout. One bucket has nothing to refit."""
    import random

    from services.common.cost_model import load_presets
    from services.policy.replan import refit_thresholds
    from services.policy.search import BucketPlan, SearchOptions, WorkloadStats

    rng = random.Random(0)
    lengths = [rng.gauss(2000, 300) for _ in range(180)] + [rng.gauss(30000, 3000) for _ in range(20)]
    stats = WorkloadStats(64, lengths, mean_turns=6, mean_tool_s=5.0, prompt_tokens=2000)
    cm = load_presets("H100", "qwen3-14b")
    stale = [BucketPlan("short", 1, 4, 500), BucketPlan("long", 2, 4, float("inf"))]
    refit = refit_thresholds(cm, stats, stale, SearchOptions(max_seqs=16))
    assert refit.buckets is not None and refit.best_s < refit.current_s and refit.gain > 0
    assert [(b.name, b.tp, b.replicas) for b in refit.buckets] == [("short", 1, 4), ("long", 2, 4)]
    assert stats.quantile(0.5) <= refit.buckets[0].max_tokens < 30000
    assert refit.buckets[-1].max_tokens == float("inf")
    again = refit_thresholds(cm, stats, refit.buckets, SearchOptions(max_seqs=16))
    assert again.buckets is None and again.gain == 0, "the refit layout is a fixed point"
    single = refit_thresholds(cm, stats, [BucketPlan("all", 1, 8, float("inf"))], SearchOptions())
    assert single.buckets is None


def test_the_live_replanner_waits_for_data_and_an_interval_and_only_refits_cmlfq_buckets():
    import random

    from services.common.contracts import ev
    from services.common.runconfig import RunConfig
    from services.planner.refit import LiveReplanner

    def cfg(max_staleness=0, **rollout):
        base = {
            "engines": 4,
            "backend": "emulated",
            "max_batch": 16,
            "buckets": [{"name": "short", "max_output_tokens": 500}, {"name": "long", "tensor_parallel": 2}],
        }
        return RunConfig.model_validate(
            {
                "rollout": base | rollout,
                "training": {"groups_per_step": 16, "max_staleness": max_staleness},
                # the analytical model alone (tests/unit/test_whatif.py simulates the candidates)
                "planner": {
                    "interval_s": 10.0,
                    "cooldown_s": 0.0,
                    "min_samples": 100,
                    "what_if": {"budget_s": 0.0},
                },
            }
        )

    rng = random.Random(0)
    lengths = [int(rng.gauss(2000, 300)) for _ in range(180)] + [
        int(rng.gauss(30000, 3000)) for _ in range(20)
    ]
    stats = ev.WorkloadStats(
        trajectory_output_tokens=lengths, tool_s_per_turn=5.0, prompt_tokens=2000, turns_per_trajectory_mean=6
    )
    buckets = [
        ev.BucketSpec(name="short", tensor_parallel=1, max_output_tokens=500),
        ev.BucketSpec(name="long", tensor_parallel=2),
    ]
    replicas = {"short": 2, "long": 2}
    r = LiveReplanner(cfg())
    few = ev.WorkloadStats(trajectory_output_tokens=lengths[:50])
    r.observe_workload(0.0, few)
    assert r.decide(100.0, buckets, replicas) is None, "fewer samples than min_samples"
    r = LiveReplanner(cfg())
    r.observe_workload(0.0, stats)
    assert r.decide(5.0, buckets, replicas) is None, "the first re-fit waits one interval of data"
    d = r.decide(10.0, buckets, replicas)
    assert d is not None and d.trigger == "interval" and d.gain > 0.03
    assert d.limits[0] > 500 and d.limits[-1] == float("inf")
    short, long_ = lengths[:180], lengths[180:]

    def early(finished: list[int], running: list[int]) -> list[float] | None:
        r = LiveReplanner(cfg())
        seen = ev.WorkloadStats(
            trajectory_output_tokens=finished,
            running_output_tokens=running,
            tool_s_per_turn=5.0,
            prompt_tokens=2000,
            turns_per_trajectory_mean=6,
        )
        r.observe_workload(0.0, seen)
        refit = r.decide(10.0, buckets, replicas)
        return None if refit is None else refit.limits

    # the same cohort while half its long trajectories are still running (half-way): the
    # threshold is where the finished cohort puts it
    assert early(short + long_[:10], [n // 2 for n in long_[10:]]) == d.limits
    # only the short ones finished so far: counted as censored, the running ones still move the
    # threshold up from 500; left out, there is nothing to re-fit to
    moved = early(short, [n // 2 for n in long_])
    assert moved is not None and moved[0] > 500
    assert early(short, []) is None
    for off in (cfg(policy="least_loaded"), cfg(buckets=[{"name": "all"}])):
        r = LiveReplanner(off)
        r.observe_workload(0.0, stats)
        assert r.decide(100.0, buckets, replicas) is None
    # The search scores layouts under the job's staleness bound: overlapping steps spread the tail.
    r = LiveReplanner(cfg(max_staleness=2))
    r.observe_workload(0.0, stats)
    overlapped = r.decide(10.0, buckets, replicas)
    assert overlapped is not None and overlapped.current_s < d.current_s


def test_length_sample_without_running_ones_is_the_finished_lengths() -> None:
    assert length_sample([30, 10, 20]) == [10.0, 20.0, 30.0]
    assert length_sample([], []) == []


def test_length_sample_gives_a_running_ones_share_to_the_longer_finished_ones() -> None:
    # Kaplan-Meier by hand: at 1 one of 3 at risk ends (1/3); 2 is censored; at 3 the last ends (2/3)
    assert length_sample([1, 3], [2]) == [1.0, 3.0, 3.0]
    # nothing finished beyond the running ones: their share stays at the longest so far (a bound)
    assert length_sample([1], [5, 8]) == [1.0, 8.0, 8.0]


def test_length_sample_recovers_the_lengths_that_the_finished_ones_understate() -> None:
    """A cohort launched over 100 s, each trajectory generating for as long as its length (a
    heavy tail), seen at 150 s: the long ones are still running. The finished ones alone put the
    median and p90 far too low; the estimate that counts the running ones as censored does not."""
    rng = random.Random(7)
    launches = [rng.uniform(0, 100) for _ in range(4000)]
    lengths = [rng.lognormvariate(4.0, 1.0) for _ in launches]  # median 55 s of generation
    now = 200.0
    finished = [n for t, n in zip(launches, lengths, strict=True) if t + n <= now]
    running = [now - t for t, n in zip(launches, lengths, strict=True) if t + n > now]
    assert len(running) > 0.1 * len(launches)

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[int(p * (len(xs) - 1))]

    for p in (0.5, 0.9):
        truth, naive, corrected = q(lengths, p), q(finished, p), q(length_sample(finished, running), p)
        assert naive < 0.85 * truth  # the bias being corrected is real here
        assert corrected == pytest.approx(truth, rel=0.08)


def _drifted_stats(median: float, seed: int = 0) -> WorkloadStats:
    rng = random.Random(seed)
    lengths = [max(10, int(rng.lognormvariate(math.log(median), 0.8))) for _ in range(256)]
    return WorkloadStats(32, lengths, mean_turns=6, mean_tool_s=5.0, prompt_tokens=2000)


def test_relayout_finds_what_an_exhaustive_search_over_rollout_time_finds_within_the_pool() -> None:
    """The re-layout's per-bucket tables give the layout that scoring every (TP per bucket, engines
    per bucket, thresholds) with `rollout_time` itself gives, within the pool's engines and GPUs,
    and it is never predicted worse than new thresholds alone."""
    cm = load_presets("H100", "qwen3-14b")
    opts = SearchOptions(max_seqs=16, bucket_tps=(1, 2, 4))
    buckets = [BucketPlan("short", 1, 3, 2000), BucketPlan("long", 2, 3, math.inf)]
    pool = EnginePool(engines=6, gpus=9)
    for median in (800.0, 6000.0):
        stats = _drifted_stats(median)
        got = refit_layout(cm, stats, buckets, opts, pool)
        xs = stats.output_tokens
        qs = sorted({xs[min(len(xs) - 1, int(q * len(xs)))] for q in REFIT_QUANTILES})
        best = math.inf
        for tps in itertools.combinations_with_replacement((1, 2, 4), 2):
            for r0, r1 in itertools.product(range(1, 7), repeat=2):
                if r0 + r1 > 6 or tps[0] * r0 + tps[1] * r1 > 9:
                    continue
                for cut in qs:
                    cand = [BucketPlan("short", tps[0], r0, cut), BucketPlan("long", tps[1], r1, math.inf)]
                    best = min(best, rollout_time(cm, stats, cand, opts))
        assert got.buckets is not None
        assert got.best_s == pytest.approx(best, rel=1e-9)
        assert got.best_s == pytest.approx(rollout_time(cm, stats, got.buckets, opts), rel=1e-9)
        assert sum(b.replicas for b in got.buckets) <= 6 and sum(b.gpus for b in got.buckets) <= 9
        assert got.best_s <= refit_thresholds(cm, stats, buckets, opts).best_s
        assert [b.name for b in got.buckets] == ["short", "long"] and math.isinf(got.buckets[-1].max_tokens)


def test_relayout_with_fixed_tps_moves_engines_only_between_buckets_of_their_tp() -> None:
    """Real engines keep the TP they started with: the two TP1 buckets share their five engines
    however the lengths move, and the TP2 bucket keeps its two."""

    cm = load_presets("H100", "qwen3-14b")
    buckets = [BucketPlan("a", 1, 4, 500), BucketPlan("b", 1, 1, 1000), BucketPlan("c", 2, 2, math.inf)]
    moved = 0
    for median in (300.0, 3000.0, 30000.0):
        got = refit_layout(
            cm, _drifted_stats(median), buckets, SearchOptions(max_seqs=16), EnginePool(7, 9, True)
        )
        if got.buckets is None:
            continue
        assert [b.tp for b in got.buckets] == [1, 1, 2]
        assert got.buckets[0].replicas + got.buckets[1].replicas == 5 and got.buckets[2].replicas == 2
        assert min(b.replicas for b in got.buckets) >= 1
        moved += got.buckets[0].replicas != 4
    assert moved, "longer lengths want more engines past the first threshold"


def test_relayout_leaves_the_layout_alone_when_nothing_beats_it() -> None:
    """A layout already the best the pool allows for these lengths is kept (no candidate)."""

    cm = load_presets("H100", "qwen3-14b")
    stats = _drifted_stats(3000.0)
    opts = SearchOptions(max_seqs=16)
    pool = EnginePool(16, 24)

    first = refit_layout(
        cm, stats, [BucketPlan("s", 1, 8, 2000), BucketPlan("l", 2, 8, math.inf)], opts, pool
    )
    assert first.buckets is not None and first.gain > 0
    again = refit_layout(cm, stats, first.buckets, opts, pool)
    assert again.buckets is None and again.best_s == again.current_s


def test_worker_ids_order_by_name_then_number() -> None:
    ids = ["rollout-engine-10", "rollout-engine-2", "e11", "e3", "rollout-engine-1"]
    assert sorted(ids, key=by_id) == [
        "e3",
        "e11",
        "rollout-engine-1",
        "rollout-engine-2",
        "rollout-engine-10",
    ]


def test_assign_layout_keeps_each_buckets_first_engines_and_fills_from_spares_then_surplus() -> None:
    """8 TP1 in a + 8 TP2 in b (24 GPUs) and one spare keeping 4 GPUs (28), to a=1xTP4, b=5xTP4:
    a keeps its first engine by number (e2 before e10), b its first five; the spare goes to a
    first, then a's surplus; the rest are spares with the 8 GPUs left over between them."""
    a = [(f"e{i}", 1) for i in (10, 2, 3, 4, 5, 6, 7, 8)]
    b = [(f"e{i}", 2) for i in range(11, 19)]
    got = assign_layout(
        {"a": a, "b": b}, [("e20", 4)], [BucketPlan("a", 4, 1, 500), BucketPlan("b", 4, 5, math.inf)], 28
    )
    assert {e: v for e, v in got.items() if v[0]} == {
        "e2": ("a", 4),
        **{f"e{i}": ("b", 4) for i in range(11, 16)},
    }
    assert list(got)[:2] == ["e2", "e11"]
    spares = {e: v[1] for e, v in got.items() if not v[0]}
    assert sorted(spares, key=by_id) == [
        "e3",
        "e4",
        "e5",
        "e6",
        "e7",
        "e8",
        "e10",
        "e16",
        "e17",
        "e18",
        "e20",
    ]
    assert sum(spares.values()) == 28 - 24 and max(spares.values()) - min(spares.values()) <= 1
    assert len(got) == 17


def test_assign_layout_with_fixed_tps_gives_a_bucket_only_engines_of_its_tp() -> None:
    """a (TP1) and c (TP2) want more engines; b (TP1) has surplus: only a gets them, c stays short."""
    members = {"a": [("e1", 1)], "b": [("e2", 1), ("e3", 1), ("e4", 1)], "c": [("e5", 2)]}
    layout = [BucketPlan("a", 1, 2, 500), BucketPlan("b", 1, 1, 1000), BucketPlan("c", 2, 3, math.inf)]
    got = assign_layout(members, [], layout, 7, fixed_tp=True)
    assert got == {"e1": ("a", 1), "e3": ("a", 1), "e2": ("b", 1), "e5": ("c", 2), "e4": ("", 7 - 5)}
