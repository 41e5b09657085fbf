import pytest

from services.policy.hybrid_pool import HybridPool, HybridWorker, InvalidTransition, PoolPolicy, Role


def test_join_walks_requested_fetching_catching_up_active_then_release():
    w = HybridWorker("w0")
    w.request_join(1.0)
    assert w.joining and w.role == Role.REQUESTED
    w.start_fetch(2.0)
    w.fetched(5.0)
    assert w.role == Role.CATCHING_UP
    w.activate(6.0)
    assert not w.joining and w.role == Role.ACTIVE and w.since == 6.0
    w.release(40.0)
    w.released(41.0)
    assert w.role == Role.ROLLOUT
    assert [r for _, r in w.history] == [
        Role.REQUESTED,
        Role.FETCHING_STATE,
        Role.CATCHING_UP,
        Role.ACTIVE,
        Role.RELEASING,
        Role.ROLLOUT,
    ]


@pytest.mark.parametrize("steps", [0, 1, 2])
def test_a_pending_join_can_be_cancelled_from_every_joining_state(steps):
    w = HybridWorker("w0")
    w.request_join(0.0)
    for go in (w.start_fetch, w.fetched)[:steps]:
        go(1.0)
    w.cancel(2.0)
    assert w.role == Role.ROLLOUT


def test_illegal_transitions_raise_and_leave_the_worker_unchanged():
    w = HybridWorker("w0")
    with pytest.raises(InvalidTransition):
        w.activate(0.0)
    with pytest.raises(InvalidTransition):
        w.cancel(0.0)
    w.request_join(0.0)
    w.start_fetch(0.0)
    w.fetched(0.0)
    w.activate(0.0)
    with pytest.raises(InvalidTransition):
        w.cancel(1.0)  # active workers release at a step boundary, they do not cancel
    assert w.role == Role.ACTIVE


def _pool(n=2, **kw) -> HybridPool:
    return HybridPool([f"w{i}" for i in range(n)], PoolPolicy(hold_s=5.0, min_active_s=30.0, **kw))


def test_join_needs_low_demand_held_for_hold_s_and_a_waiting_trainer():
    pool = _pool()
    assert pool.decide(0.0, 0.1, train_waiting=True) == []
    assert pool.decide(4.0, 0.1, train_waiting=True) == []
    assert [a.action for a in pool.decide(5.0, 0.1, train_waiting=True)] == ["join", "join"]
    pool2 = _pool()
    pool2.decide(0.0, 0.1, train_waiting=False)
    assert pool2.decide(10.0, 0.1, train_waiting=False) == []


def test_a_demand_blip_resets_the_hold_timer():
    pool = _pool()
    pool.decide(0.0, 0.1, True)
    pool.decide(3.0, 0.5, True)  # back above join_below: timer restarts
    assert pool.decide(6.0, 0.1, True) == []
    assert pool.decide(11.0, 0.1, True) != []


def test_target_limits_how_many_workers_join():
    pool = _pool(n=4)
    pool.set_target(1)
    pool.decide(0.0, 0.0, True)
    acts = pool.decide(5.0, 0.0, True)
    assert len(acts) == 1
    pool.workers[acts[0].worker_id].request_join(5.0)
    assert pool.decide(6.0, 0.0, True) == []


def _activate(w: HybridWorker, t: float) -> None:
    w.request_join(t)
    w.start_fetch(t)
    w.fetched(t)
    w.activate(t)


def test_high_demand_cancels_pending_joins_and_releases_active_workers_only_after_min_active():
    pool = _pool()
    w0, w1 = pool.workers["w0"], pool.workers["w1"]
    _activate(w0, 0.0)
    w1.request_join(0.0)
    pool.decide(10.0, 0.95, True)
    acts = {(a.worker_id, a.action) for a in pool.decide(15.0, 0.95, True)}
    assert acts == {("w1", "cancel")}  # w0 has been active 15 s < min_active_s
    acts = {(a.worker_id, a.action) for a in pool.decide(31.0, 0.95, True)}
    assert ("w0", "release") in acts


def test_demand_between_thresholds_changes_nothing_hysteresis():
    pool = _pool()
    _activate(pool.workers["w0"], 0.0)
    for t in range(0, 200, 5):
        assert pool.decide(float(t), 0.6, True) == []


def test_active_worker_is_released_when_the_trainer_stays_without_work():
    pool = _pool()
    _activate(pool.workers["w0"], 0.0)
    pool.decide(40.0, 0.6, train_waiting=False)
    assert [(a.worker_id, a.action) for a in pool.decide(45.0, 0.6, False)] == [("w0", "release")]


def _live_cfg(**hybrid):
    from services.common.runconfig import RunConfig

    return RunConfig.model_validate(
        {
            "rollout": {"engines": 3, "max_batch": 4},
            "planner": {"hybrid": {"workers": 1, "hold_s": 1.0, "min_active_s": 5.0, **hybrid}},
        }
    )


def test_live_pool_never_takes_the_last_serving_engine_and_follows_the_workers_reports():
    from services.common.contracts import ev
    from services.common.runconfig import PlanJob
    from services.planner.elastic import LivePool

    pool = LivePool(PlanJob.of(_live_cfg(workers=2)))
    pool.observe_workload(ev.WorkloadStats(queued_turns_by_bucket={"short": 0}))
    pool.observe_step(ev.TrainMetrics(step=1, groups_ready=2))
    roles = {"e0": ("rollout", "short"), "e1": ("rollout", "short")}
    assert pool.decide(0.0, roles) == []  # the condition must hold for hold_s first
    moves = pool.decide(1.5, roles)
    assert [(m.worker_id, m.to_role) for m in moves] == [("e0", "hybrid")], "e1 stays: the bucket's last"
    roles["e0"] = ("hybrid", "short")
    for state in ("drained", "fetched", "joined"):
        pool.observe_state(2.0, ev.HybridState(worker_id="e0", state=state))
    assert pool.pool.workers["e0"].role == Role.ACTIVE
    pool.observe_workload(ev.WorkloadStats(queued_turns_by_bucket={"short": 20}))  # 5 per slot
    assert pool.decide(3.0, roles) == [] and pool.decide(4.5, roles) == []  # before min_active_s
    assert [(m.worker_id, m.to_role, m.why) for m in pool.decide(7.5, roles)] == [
        ("e0", "rollout", "release")
    ]


def test_live_pool_config_errors_are_clear():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="planner.hybrid.bucket"):
        _live_cfg(bucket="nowhere")
    with pytest.raises(ValidationError, match="at least one engine serving"):
        _live_cfg(workers=3)


def test_live_pool_walks_the_steps_a_report_skips():
    from services.common.contracts import ev
    from services.common.runconfig import PlanJob
    from services.planner.elastic import LivePool

    pool = LivePool(PlanJob.of(_live_cfg()))
    pool.decide(0.0, {"e0": ("rollout", "short"), "e1": ("rollout", "short")})
    w = pool.pool.workers["e0"]
    w.request_join(1.0)
    pool.observe_state(2.0, ev.HybridState(worker_id="e0", state="joined"))  # still in the group
    assert w.role == Role.ACTIVE
    pool.observe_state(3.0, ev.HybridState(worker_id="e0", state="drained"))  # late, changes nothing
    assert w.role == Role.ACTIVE
