import json
import math
from collections import Counter

import pytest

from services.common.cost_model import load_presets
from services.common.synthetic import Workload
from services.policy.search import BucketPlan, Plan
from services.policy.speculation import SpeculationPolicy
from services.simulation.engine import Engine, Request
from services.simulation.fleet import Members
from services.simulation.ledger import CATEGORIES
from services.simulation.simulator import Simulator
from services.simulation.state import MOVED
from tools.sim.cli import main
from tools.sim.stats import mean_ci, paired_ratio
from tools.sim.systems import LIBRA_DRAFTER, LIBRA_SPECULATION, SYSTEMS, Env, baseline_system, libra_system

N_GPUS = 16
STEPS = 3


def _env(staleness: int = 1) -> Env:
    wl = Workload.load("r2e_gym")
    cm = load_presets("A800", "qwen3-14b")
    small = wl.with_overrides(cm.model.max_context, prompts_per_step=4, group_size=4)
    return Env(cm, small, N_GPUS, staleness=staleness)


@pytest.fixture(scope="module")
def env() -> Env:
    return _env()


def _system(name: str, env: Env):
    if name in ("libra", "libra-no-ehp", "libra-no-cmlfq", "libra-no-sd", "libra-no-kvm"):
        # An allocation with every mechanism present: three buckets and a hybrid pool.
        plan = Plan(
            4,
            1,
            [
                BucketPlan("short", 1, 2, 3000),
                BucketPlan("medium", 2, 1, 9000),
                BucketPlan("long", 4, 1, math.inf),
            ],
            hybrid_gpus=4,
        )
        if name == "libra-no-ehp":
            plan.hybrid_gpus, plan.train_gpus = 0, 8
        sd: dict = (
            {} if name == "libra-no-sd" else {"drafter": LIBRA_DRAFTER, "speculation": LIBRA_SPECULATION}
        )
        sd["kv_migration"] = name != "libra-no-kvm"
        return libra_system(env, name, plan, routing="pooled" if name == "libra-no-cmlfq" else "cmlfq", **sd)
    settings = {
        "verl": {"tp": 2},
        "verl-apr": {"tp": 2, "partial": 2.0},
        "areal-sd": {"split": 8, "tp": 2, "drafter": "suffix", "speculation": SpeculationPolicy("fixed", 4)},
        "areal-lend": {"split": 8, "tp": 4},
        "libra-no-grp": {"split": 8, "mix": (1, 4)},
        "length-aware": {"split": 8, "mix": (1, 2, 4)},
    }.get(name, {"split": 8, "tp": 2})
    return baseline_system(env, name, **settings)


def _run(name: str, env: Env, seed: int = 3, steps: int = STEPS) -> tuple[Simulator, Counter, set]:
    system = _system(name, env)
    finished: Counter = Counter()
    admitted: set = set()
    router = system.router
    orig_finish, orig_admit = router.finish, router.admit

    def finish(tid, total, now):
        finished[tid] += 1
        orig_finish(tid, total, now)

    def admit(tid, pid, now, tokens):
        assert tid not in admitted
        admitted.add(tid)
        return orig_admit(tid, pid, now, tokens)

    router.finish, router.admit = finish, admit
    sim = Simulator(system, env.workload, env.cm, N_GPUS, steps, seed=seed)
    sim.run()
    return sim, finished, admitted


@pytest.mark.parametrize("name", SYSTEMS)
def test_every_trajectory_finishes_at_most_once_and_gpu_time_adds_up(env, name):
    sim, finished, admitted = _run(name, env)
    per_step = env.workload.prompts_per_step * env.workload.group_size
    assert sim.version == STEPS
    assert sum(sim.step_trajs) == STEPS * per_step
    assert max(finished.values()) == 1
    assert set(finished) <= admitted
    # Every admitted trajectory either finished, is still in flight, or was aborted as too stale.
    assert len(admitted) == len(finished) + len(sim.trajs) + sim.aborted_trajectories
    assert sim.finished == len(finished)
    assert sim.ledger.total() == pytest.approx(N_GPUS * sim.now, rel=1e-6)
    assert all(v >= -1e-6 for v in sim.ledger.totals.values())
    assert set(sim.ledger.totals) <= set(CATEGORIES)


@pytest.mark.parametrize("staleness", [0, 1, 2])
@pytest.mark.parametrize("name", ["libra", "areal", "homogeneous-lb", "length-aware", "verl-apr"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_trained_group_is_older_than_the_staleness_bound(name, staleness, seed):
    env = _env(staleness)
    sim, _, _ = _run(name, env, seed=seed, steps=4)
    assert len(sim.trained_staleness) == 4 * env.workload.prompts_per_step
    # The bound judges a group's oldest token (services/policy/staleness.py).
    assert len(sim.trained_oldest_staleness) == len(sim.trained_staleness)
    assert min(sim.trained_oldest_staleness) >= 0
    assert max(sim.trained_oldest_staleness) <= staleness
    # No token is older than its group's admission, the mean token no older than the oldest one,
    # none newer than the trainer.
    assert len(sim.trained_token_staleness) == len(sim.trained_staleness)
    assert all(
        0 <= t <= o + 1e-9 and o <= a
        for t, o, a in zip(
            sim.trained_token_staleness, sim.trained_oldest_staleness, sim.trained_staleness, strict=True
        )
    )


def test_token_staleness_counts_each_segment_at_the_version_that_generated_it(env):
    sync, _, _ = _run("verl", env, steps=3)
    assert sync.trained_token_staleness == [0.0] * len(sync.trained_staleness)  # one version per step
    recompute, _, _ = _run("areal", _env(2), seed=1, steps=5)
    admission = sum(recompute.trained_staleness) / len(recompute.trained_staleness)
    tokens = sum(recompute.trained_token_staleness) / len(recompute.trained_token_staleness)
    # Interruptible generation continues old groups under newer weights: their later segments
    # are fresher than their admission, so the token-weighted staleness is strictly lower.
    assert 0 < tokens < admission


class _TokensChecked(Simulator):
    """Every trajectory that finishes has generated exactly its output, each token counted once
    at the version that generated it, however often it was stopped and continued."""

    def _finish(self, tid):
        tr = self.trajs[tid]
        assert tr.gen_tokens == tr.spec.output_tokens, (tid, tr.gen_tokens, tr.spec.output_tokens)
        super()._finish(tid)


@pytest.mark.parametrize("seed", [1, 2])
def test_partial_rollout_trains_the_first_complete_groups_and_carries_the_rest(seed):
    env = _env(2)
    B = env.workload.prompts_per_step
    plain = _TokensChecked(baseline_system(env, "verl", tp=2), env.workload, env.cm, N_GPUS, 5, seed=seed)
    plain.run()
    system = baseline_system(env, "verl-apr", tp=2, partial=2.0)
    sim = _TokensChecked(system, env.workload, env.cm, N_GPUS, 5, seed=seed)
    sim.run()
    assert sum(sim.step_trajs) == sum(plain.step_trajs) == 5 * B * env.workload.group_size
    # Over-provisioned: twice the batch in flight, never more; nothing lost.
    assert len(sim.groups) <= 2 * B
    assert sim.admitted_groups == 5 * B + sim.dropped_groups + len(sim.groups)
    # Turns stopped by a step continue under the next weights: groups trained a step or more
    # after admission, their tokens fresher than their admission, their context re-prefilled.
    assert max(sim.trained_staleness) >= 1 and max(sim.trained_staleness) <= env.staleness
    assert 0 < sum(sim.trained_token_staleness) < sum(sim.trained_staleness)
    assert sim.reprefill_tokens > 0 and plain.reprefill_tokens == 0
    assert plain.trained_staleness == [0] * len(plain.trained_staleness)
    # The rollout phase ends at the first B complete groups, not at the last trajectory.
    assert sim.now < plain.now
    assert sim.ledger.total() == pytest.approx(N_GPUS * sim.now, rel=1e-6)


def test_partial_rollout_is_for_colocated_systems_with_a_ratio_of_at_least_one(env):
    with pytest.raises(ValueError, match="verl-apr only"):
        baseline_system(env, "verl", tp=2, partial=2.0)
    with pytest.raises(ValueError, match="over-provision ratio >= 1"):
        Simulator(baseline_system(env, "verl-apr", tp=2, partial=0.5), env.workload, env.cm, N_GPUS, 1)
    areal = baseline_system(env, "areal", split=8, tp=2)
    areal.partial_rollout = 2.0
    with pytest.raises(ValueError, match="needs a colocated system"):
        Simulator(areal, env.workload, env.cm, N_GPUS, 1)


def test_hybrid_workers_join_training_at_step_boundaries_and_come_back(env):
    sim, _, _ = _run("libra", env, steps=5)
    assert sim.hybrid.pool is not None
    roles = Counter(r.value for w in sim.hybrid.pool.workers.values() for _, r in w.history)
    assert roles["active"] >= 1 and roles["rollout"] >= 1
    assert sim.hybrid.joins == roles["active"]
    # the GPU timeline counts a training hybrid worker's GPUs, not the worker
    tp, trainer = sim.sys.hybrid_tp, sim.sys.train_gpus
    training = [train for _, _, train, _ in sim.timeline]
    assert tp > 1 and trainer % tp == 0 and any(t > trainer for t in training)
    assert all(t % tp == 0 and t <= trainer + sim.sys.hybrid_gpus for t in training)


def test_same_seed_same_result_and_same_workload_across_systems(env):
    a, _, _ = _run("homogeneous-lb", env)
    b, _, _ = _run("homogeneous-lb", env)
    assert a.step_ends == b.step_ends
    c, _, _ = _run("disaggregated-static", env)
    assert a.step_tokens[0] == c.step_tokens[0]  # group k is the same draw in every system


def _engine(env: Env) -> Engine:
    return Engine("e0", "all", 1, env.cm, max_seqs=8)


def test_a_paused_trajectory_keeps_its_context_cached_until_weights_change(env):
    e = _engine(env)
    e.open(0.0)
    e.join(Request("t", 100, 2000), 0.0, 2000, "p")
    done = e.pop_done(e.next_event())
    assert [r.traj_id for r in done] == ["t"] and e.prefix.tokens == 2100
    e.load_weights(e.t, 1.0, version=1)
    assert e.prefix.tokens == 0 and not e.prefix.prompts and e.version == 1
    assert not e.prefix.take("t")  # the next turn must re-prefill its whole context


def test_an_engine_beside_busy_ones_runs_at_its_pace_from_then_on(env):
    """Engines sharing a host (`Calibration.host_sharing`): what ran before a change of pace keeps
    its time, what is left takes `pace` times as long."""
    alone, shared = _engine(env), _engine(env)
    for e in (alone, shared):
        e.open(0.0)
        e.join(Request("t", 200, 500), 0.0, 500, "p")
    half = (alone.next_event() + alone.resume) / 2  # half-way through its decode
    alone.set_pace(half, 1.0)  # priced again at half-way, as the other (its context has grown)
    shared.set_pace(half, 2.0)
    assert shared.next_event() == pytest.approx(half + 2 * (alone.next_event() - half))
    assert shared.pace == 2.0 and [r.traj_id for r in shared.pop_done(shared.next_event())] == ["t"]


def test_weight_load_makes_running_sequences_re_prefill_their_context(env):
    e = _engine(env)
    e.open(0.0)
    e.join(Request("t", 1000, 30_000), 0.0, 30_000, "p")
    t = e.resume + 500 * e.step
    e.advance(t)
    before = e.resume
    spent = e.load_weights(t, 1.0, version=1)
    assert spent == pytest.approx(env.cm.prefill_s(30_500, 0, 1), rel=1e-3)
    assert e.resume == pytest.approx(max(before, t) + 1.0 + spent)


def test_prefix_cache_evicts_least_recently_paused_when_running_sequences_need_kv(env):
    e = _engine(env)
    e.open(0.0)
    cap = e.kv_capacity
    e.join(Request("old", 10, cap // 3), 0.0, 1, "p")
    e.join(Request("new", 10, cap // 3), 0.0, 1, "p")
    e.pop_done(e.next_event() + 1.0)
    assert set(e.prefix.entries) == {"old", "new"}
    e.join(Request("big", 10, cap // 2), e.t, 1, "q")
    assert "old" not in e.prefix.entries and "new" in e.prefix.entries
    assert e.kv_used + e.prefix.tokens <= cap


def test_recompute_updates_re_prefill_and_drain_updates_wait(env):
    recompute, _, _ = _run("areal", env, steps=4)
    drain, _, _ = _run("homogeneous-lb", env, steps=4)
    assert recompute.sys.update_mode == "recompute" and drain.sys.update_mode == "drain"
    assert recompute.reprefill_tokens > 0
    assert all(e.version == 3 for e in recompute.engines.values())


def test_trajectories_never_outgrow_the_model_window():
    wl = Workload.load("r2e_gym").with_overrides(8192)
    import random

    rng = random.Random(0)
    specs = [s for g in range(64) for s in wl.sample_group(rng, f"p{g}", 0)]
    assert max(s.context_tokens for s in specs) < 8192
    assert any(s.context_tokens > 6000 for s in specs)


def test_confidence_interval_math():
    m, (lo, hi) = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0
    assert hi - m == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert lo == pytest.approx(2 * m - hi)
    assert mean_ci([5.0]) == (5.0, (5.0, 5.0))
    r, (rlo, rhi) = paired_ratio([2.0, 4.0], [1.0, 2.0])
    assert (r, rlo, rhi) == (2.0, 2.0, 2.0)  # the same ratio on every seed: no uncertainty
    with pytest.raises(ValueError):
        mean_ci([])
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_cli_runs_a_workload_file_over_seeds_and_writes_cis(tmp_path):
    out = tmp_path / "out"
    rc = main(["--workload", "cpu_tools", "--gpus", "8", "--systems", "libra,homogeneous-lb",
               "--steps", "3", "--seeds", "2", "--jobs", "2", "--out", str(out), "--no-plots"])  # fmt: skip
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"libra", "homogeneous-lb"}
    for r in results["systems"].values():
        lo, hi = r["ci95"]
        assert lo <= r["trajectories_per_s"] <= hi
        assert len(r["trajectories_per_s_by_seed"]) == 2
        assert r["gpu_seconds_accounted"] == pytest.approx(r["gpu_seconds_total"], rel=1e-6)
    ratio = results["ratios_vs_libra"]["homogeneous-lb"]
    assert ratio["ci95"][0] <= ratio["mean"] <= ratio["ci95"][1]
    assert results["planning_seed"] not in results["reported_seeds"]
    assert results["events"] > 0 and results["wall_s"] > 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("name: broken\nmax_turns: 4\n", "missing field 'max_new_tokens'"),
        ("name: [unclosed\n", "not valid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_bad_workload_file_exits_2_with_a_clear_message(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    rc = main(["--workload", str(bad), "--gpus", "16", "--out", str(tmp_path / "o"), "--no-plots"])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("libra sim:")
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: {**s, "temperature": 1.0}, "unknown field 'temperature'"),
        (lambda s: {**s, "stop": {**s["stop"], "sucess": 0.3}}, "unknown field 'sucess'"),
        (
            lambda s: {**s, "tools": {**s["tools"], "shell": {**s["tools"]["shell"], "latncy": 1}}},
            "unknown field 'latncy'",
        ),
        (lambda s: {**s, "group_size": 0}, "group_size must be an integer of at least 1"),
    ],
)
def test_unknown_or_invalid_workload_fields_are_clear_errors(tmp_path, capsys, edit, message):
    import yaml

    spec = edit(Workload.load("r2e_gym").spec)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    assert main(["--workload", str(bad), "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert message in capsys.readouterr().err


def test_unknown_system_exits_2(tmp_path, capsys):
    rc = main(["--workload", "r2e_gym", "--systems", "nope", "--out", str(tmp_path), "--no-plots"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err


def test_libras_planner_menu_holds_every_homogeneous_baseline_setting_and_colocated():
    from tools.sim.jobs import Job, Runner, Scenario
    from tools.sim.scenarios import _label, plan_for
    from tools.sim.systems import homogeneous_plan, plan_key, sweep_grid

    scenario = Scenario("t", "A800", "qwen3-14b", "search_r1", 32, 2, ("libra",), sweep_steps=1)
    runner = Runner(scenario, None, jobs=1)
    seen: list[dict] = []

    def measure(cands):
        seen.extend(c for _, c in cands)
        # Pretend the colocated TP4 proposal is the fastest: the planner must be able to pick it.
        return [2.0 if c.get("colocated_tp") == 4 else 1.0 for _, c in cands]

    static, hybrid = plan_for(runner, "cmlfq", measure)
    keys = {k for _, _, k in static}
    for g in sweep_grid("areal", runner.env):
        plan = homogeneous_plan(runner.env, g["split"], g["tp"])
        if plan is not None:
            assert plan_key(plan) in keys
    assert {f"colocated/TP{tp}" for tp in (1, 2, 4, 8)} <= keys
    # ... and every partial-rollout setting `verl-apr` sweeps, as a colocated plan of its own.
    assert {_label(g) for g in sweep_grid("verl-apr", runner.env)} <= keys
    assert max(static + hybrid, key=lambda x: x[0])[2] == "colocated/TP4"
    # A colocated plan builds and runs as Libra in the time-shared mode.
    system = runner.build(Job("libra", {"colocated_tp": 4}, 0, 1))
    assert system.mode == "sync" and system.buckets[0].tp == 4


def test_a_slice_plan_scales_to_the_whole_cluster():
    from tools.sim.scenarios import scale_settings

    plan = Plan(24, 4, [BucketPlan("all", 8, 3, math.inf)], 0)
    big = Plan.from_dict(
        scale_settings({"plan": plan.to_dict(), "routing": "cmlfq"}, 1024 / 48, 1024)["plan"]
    )
    assert big.buckets[0].replicas == 64 and big.buckets[0].tp == 8
    assert big.total_gpus == 1024 and big.train_gpus == 512
    mixed = Plan(16, 4, [BucketPlan("short", 2, 4, 5000.0), BucketPlan("long", 8, 3, math.inf)], 8)
    big = Plan.from_dict(scale_settings({"plan": mixed.to_dict()}, 4.0, 192)["plan"])
    assert [b.replicas for b in big.buckets] == [16, 12] and big.hybrid_gpus == 32
    assert big.total_gpus == 192
    assert scale_settings({"colocated_tp": 4}, 21.3, 1024) == {"colocated_tp": 4}
    with pytest.raises(ValueError):
        scale_settings({"plan": Plan(1, 1, [BucketPlan("all", 8, 6, math.inf)], 0).to_dict()}, 2.0, 96)


@pytest.mark.parametrize(("seed", "policy"), [(1, "predictive"), (2, "predictive"), (1, "always")])
def test_lent_training_gpus_serve_rollout_between_steps_and_lose_nothing(env, seed, policy):
    plan = Plan(8, 4, [BucketPlan("all", 4, 2, math.inf)], 0)
    system = libra_system(env, "libra", plan, lend_tp=4)
    system.lend_policy = policy
    sim = Simulator(system, env.workload, env.cm, N_GPUS, 4, seed=seed)
    sim.run()
    t = sim.training
    assert t.lends >= 1 and t.reclaims >= 1 and t.reclaims <= t.lends
    if policy == "always":
        assert t.early_reclaims == 0, "always: the GPUs come back when a batch is complete"
    assert sim.version == 4
    assert sum(sim.step_trajs) == 4 * env.workload.prompts_per_step * env.workload.group_size
    assert max(sim.trained_staleness) <= env.staleness
    assert len(sim.training.lent) == 2 and all(e.opened_s > 0 and e.busy_s > 0 for e in sim.training.lent)
    # Every GPU-second is in exactly one place: lent engines while lent, the trainer otherwise.
    assert sim.ledger.total() == pytest.approx(N_GPUS * sim.now, rel=1e-6)
    assert sim.ledger.totals["switch"] > 0 and sim.ledger.totals["train_busy"] > 0
    assert all(
        tr.partial < tr.spec.turns[tr.turn].output_tokens for tr in sim.trajs.values() if not tr.in_tool
    )


def test_lending_needs_whole_engines_on_the_training_gpus(env):
    plan = Plan(6, 2, [BucketPlan("all", 2, 5, math.inf)], 0)
    with pytest.raises(ValueError, match="cannot lend"):
        Simulator(libra_system(env, "libra", plan, lend_tp=4), env.workload, env.cm, N_GPUS, 1)


def test_a_finite_job_launches_its_groups_and_replacements_only_and_its_drain_is_not_steady_state(env):
    """`job_groups` is the live feed's rule (steps * groups_per_step, plus a replacement per dropped
    group); without it the simulator keeps admitting ahead, as a long run does."""
    from services.simulation.runner import steady_rate

    open_ended = _system("homogeneous-lb", env)
    sim = Simulator(open_ended, env.workload, env.cm, N_GPUS, STEPS, seed=3)
    sim.run()
    finite = _system("homogeneous-lb", env)
    finite.job_groups = STEPS * env.workload.prompts_per_step
    capped = Simulator(finite, env.workload, env.cm, N_GPUS, STEPS, seed=3)
    capped.run()
    assert capped.admitted_groups <= finite.job_groups + capped.dropped_groups
    assert sim.admitted_groups > finite.job_groups + sim.dropped_groups, "the open-ended run admits ahead"
    assert sum(capped.step_trajs) == sum(sim.step_trajs), "both train every step in full"

    assert steady_rate([10.0, 20.0, 40.0], 8) == pytest.approx(16 / 30)
    assert steady_rate([10.0, 20.0, 40.0], 8, drained=True) == pytest.approx(8 / 10)
    assert steady_rate([10.0, 20.0], 8, drained=True) == 0.0


def test_sensitivity_settings_reach_the_model_and_bad_flags_change_nothing(tmp_path, capsys):
    import dataclasses

    from tools.sim.jobs import SCENARIOS, Job, Runner
    from tools.sim.scenarios import LIBRA_SD
    from tools.sim.systems import homogeneous_plan

    sc = dataclasses.replace(
        SCENARIOS["paper-48gpu"],
        n_gpus=16,
        prompts_per_step=4,
        acceptance_scale=0.0,
        calibration=(("activation_recompute", False), ("tp_decode_efficiency", 0.66)),
    )
    runner = Runner(sc, None)
    assert runner.cm.calib.tp_decode_efficiency == 0.66 and not runner.cm.calib.activation_recompute
    plan = homogeneous_plan(runner.env, 8, 4)
    r = runner.run_one(Job("libra", {"plan": plan.to_dict(), "routing": "cmlfq", **LIBRA_SD}, 0, 2))
    assert r["speculation"]["drafter"] == "group" and r["speculation"]["accepted_tokens"] == 0.0
    out = tmp_path / "out"
    base = ["--workload", "search_r1", "--gpus", "16", "--out", str(out), "--no-plots"]
    for bad in (["--calib", "nope=1"], ["--calib", "train_mfu=high"], ["--acceptance-scale", "-1"]):
        assert main([*base, *bad]) == 2
        assert "libra sim:" in capsys.readouterr().err
    assert not out.exists()


def test_kv_migration_conserves_kv_and_moved_turns_resume_where_they_land(env):
    plan = Plan(8, 1, [BucketPlan("all", 4, 2, math.inf)], 0)
    runs = {}
    for kvm in (False, True):
        system = libra_system(env, "libra", plan, routing="pooled", replan=False, lend_tp=4, kv_migration=kvm)
        sim = Simulator(system, env.workload, env.cm, N_GPUS, 4, seed=2)
        sim.run()
        in_transit = sum(p[3] for _, _, kind, p, _ in sim.events if kind == MOVED)
        assert sim.kvm.sent_tokens == sim.kvm.received_tokens + in_transit
        assert all(v == 0 for v in sim.kvm.inbound.values()) or in_transit
        runs[kvm] = sim
    assert runs[False].kvm.moves == 0 and runs[True].kvm.moves > 0
    assert runs[True].kvm.fallbacks < runs[True].kvm.moves  # most moved turns resume without re-prefill
    assert sum(runs[True].step_trajs) == sum(runs[False].step_trajs)


def test_consolidation_evens_out_running_turns_within_capacity():
    from services.policy.consolidation import EngineSlots, consolidation_moves

    moves = consolidation_moves([EngineSlots("a", 10, 16), EngineSlots("b", 2, 16), EngineSlots("c", 3, 4)])
    after = Counter({"a": 10, "b": 2, "c": 3})
    for src, dst in moves:
        after[src] -= 1
        after[dst] += 1
    assert after == Counter({"a": 6, "b": 5, "c": 4})  # c is full; a and b differ by less than 2
    assert moves and all(src == "a" for src, _ in moves)
    assert consolidation_moves([EngineSlots("a", 3, 8), EngineSlots("b", 2, 8)]) == []
    assert consolidation_moves([EngineSlots("a", 9, 8)]) == []


def test_a_detached_sequence_takes_its_kv_and_progress_with_it(env):
    e = _engine(env)
    e.open(0.0)
    e.join(Request("stay", 400, 1000), 0.0, 1000, "p")
    e.join(Request("go", 300, 2000), 0.0, 2000, "p")
    used = e.kv_used
    t = e.resume + 100 * e.step
    out = e.detach(t, "go")
    assert out is not None
    req, done = out
    assert req.traj_id == "go" and done == pytest.approx(100, rel=1e-6)
    assert e.kv_used == used - 2300 and e.n == 1
    assert e.detach(t, "go") is None
    assert [r.traj_id for r in e.pop_done(e.next_event())] == ["stay"]


@pytest.mark.parametrize("kind", ["cmlfq", "least"])
def test_routers_send_later_turns_to_where_a_moved_turn_landed(env, kind):
    from services.policy.cmlfq import EngineView

    router = (
        libra_system(env, "libra", Plan(8, 1, [BucketPlan("all", 4, 2, math.inf)], 0)).router
        if kind == "cmlfq"
        else baseline_system(env, "areal", 8, 4).router
    )
    bucket = router.admit("t", "p", 0.0, 100)
    views = [EngineView("e0", 1, 8), EngineView("e1", 2, 8)]
    assert router.pick_engine(bucket, views, "t") == "e0"
    router.moved("t", "e1")
    assert router.pick_engine(bucket, views, "t") == "e1"  # context affinity follows the KV


def test_sensitivity_moves_each_constant_both_ways_and_reads_the_lead():
    from tools.sim.sensitivity import lead, main, points

    grid = points(["tp_decode_efficiency", "decode_overhead_s"], 0.25)
    assert grid[0] == ("as shipped", "", {})
    moved = {(c, v) for c, v, _ in grid[1:]}
    assert ("tp_decode_efficiency", "0.66") in moved and ("tp_decode_efficiency", "1") in moved
    assert ("decode_overhead_s", "0.0015") in moved and ("decode_overhead_s", "0.0025") in moved
    assert {v for c, v, _ in grid if c == "acceptance_scale"} == {"0.5", "1.5"}
    results = {
        "systems": {"libra": {"trajectories_per_s": 2.0}, "a": {"trajectories_per_s": 1.0, "settings": "x"},
                    "b": {"trajectories_per_s": 1.6, "settings": "y"}},
        "ratios_vs_libra": {"a": {"mean": 2.0, "ci95": [1.9, 2.1]}, "b": {"mean": 1.25, "ci95": [1.2, 1.3]}},
    }  # fmt: skip
    assert lead(results) == {"best": "b", "mean": 1.25, "ci95": [1.2, 1.3], "settings": "y"}
    assert main(["--constants", "nope"]) == 2
    assert main(["--systems", "areal"]) == 2


def test_predictive_lending_keeps_the_gpus_where_a_batch_is_never_far_off_and_reclaims_ahead_of_it():
    """The simulator on `libra bench live`'s configuration (32 training GPUs lending TP4 engines):
    on search_r1 a batch is often complete within a few switches, so the forecast lends less often
    than lending at every wait, and takes the GPUs back ahead of the batch; on r2e_gym's long
    waits it lends at every step."""
    import argparse

    from services.common.runconfig import RunConfig
    from services.common.synthetic import Workload
    from tools.bench_live import live_config, predicted

    def lending(workload: str, policy: str) -> dict:
        ns = argparse.Namespace(
            workload=workload, engines=16, time_scale=0.25, steps=8, groups_per_step=32, group_size=4,
            staleness=1, max_batch=16, long_tp=2, short_bucket_tokens=None, train_gpus=32, train_tp=2,
            lend_tp=4, gpu="H100", model="qwen3-14b", profile=None, seed=0, backend="emulated",
            trainer="emulated",
        )  # fmt: skip
        wl = Workload.load(workload)
        return predicted(RunConfig.model_validate(live_config(ns, wl, "cmlfq", lend=policy)), wl, 1)[
            "lending"
        ]

    short = {p: lending("search_r1", p) for p in ("always", "predictive")}
    assert short["predictive"]["lends"] < short["always"]["lends"], short
    assert short["predictive"]["early_reclaims"] >= 1 and short["always"]["early_reclaims"] == 0
    long = lending("r2e_gym", "predictive")
    assert long["lends"] >= 8 and long["early_reclaims"] >= 1, long


@pytest.mark.parametrize("seed", [0, 1])
def test_a_relayout_moves_the_simulated_engines_keeps_their_gpus_and_loses_nothing(env, seed):
    """With `relayout` the simulator's re-planner lays the engines out again as the live planner
    does (`choose_refit` with an engine pool): the engines serving afterwards stand for the rollout
    GPUs they had (12 here, the rest of them spare), every GPU-second is in the ledger, and every
    admitted trajectory finishes at most once."""
    from services.policy.replan import ReplanPolicy

    plan = Plan(4, 1, [BucketPlan("short", 1, 4, 3000), BucketPlan("long", 2, 4, math.inf)])
    system = libra_system(env, "libra", plan, relayout=True)
    system.replan = ReplanPolicy(interval_s=60.0, cooldown_s=30.0)
    finished: Counter = Counter()
    orig_finish = system.router.finish

    def finish(tid, total, now):
        finished[tid] += 1
        orig_finish(tid, total, now)

    system.router.finish = finish
    sim = Simulator(system, env.workload, env.cm, N_GPUS, 4, seed=seed)
    sim.run()
    rp = sim.replanner
    assert rp is not None and any(r["relayout"] for r in rp.replans) and rp.restarts > 0
    serving = [e for e in sim.engines.values() if e not in rp.spares]
    assert [(b.tp, b.replicas) for b in sim.sys.buckets] != [(1, 4), (2, 4)]
    assert sorted(e.tp for e in serving) == sorted(b.tp for b in sim.sys.buckets for _ in range(b.replicas))
    assert sum(e.tp for e in serving) + rp.spare.gpus == 12
    assert {e.bucket for e in serving} == {b.name for b in sim.sys.buckets}
    assert sim.ledger.total() == pytest.approx(N_GPUS * sim.now, rel=1e-6)
    assert all(v >= -1e-6 for v in sim.ledger.totals.values())
    assert finished and max(finished.values()) == 1
    assert sim.version == 4


def test_a_buckets_engines_stay_indexed_by_their_running_turns_as_turns_come_and_go(env):
    """The simulator places through the live dispatcher's load index (`Members`): each engine's
    running turns reach it as they join and end, a closed or non-accepting engine leaves it until
    it opens or accepts again, and an engine moved away leaves it."""
    members = Members()
    engines = [Engine(f"e{i}", "all", 1, env.cm, max_seqs=2) for i in range(3)]
    for e in engines:
        e.open(0.0)
        members.append(e)
    least = lambda: members.index.least(lambda _: True)  # noqa: E731
    assert least() == "e0"  # all idle: the first in order
    engines[0].join(Request("a", 50, 100), 0.0, 100, "p")
    assert least() == "e1"
    for i, e in enumerate(engines[1:]):
        e.join(Request(f"b{i}", 80, 100), 0.0, 100, "p")
    assert least() == "e0"  # one of two slots each: the first in order again
    engines[0].join(Request("c", 500, 100), 0.0, 100, "p")
    assert "e0" not in members.index and least() == "e1"  # full
    done = engines[0].pop_done(engines[0].next_event())
    assert [r.traj_id for r in done] == ["a"] and "e0" in members.index
    engines[2].accepting = False  # finishing its turns before it leaves rollout
    engines[0].close(1.0)
    assert "e0" not in members.index and "e2" not in members.index and least() == "e1"
    engines[0].open(2.0)
    engines[2].accepting = True
    assert "e0" in members.index and "e2" in members.index
    members.remove(engines[1])
    assert engines[1] not in members and len(members) == 2 and least() == "e0"
    engines[1].pop_done(engines[1].next_event())  # no longer its routing key's: nothing changes
    assert "e1" not in members.index


def test_settings_are_confirmed_over_the_runs_length_not_the_sweeps():
    """A candidate that leads the short sweep and falls behind over the run (its groups going
    stale late) is not the one chosen: the best few are confirmed over the reported length."""
    from tools.sim.jobs import Runner, Scenario
    from tools.sim.scenarios import choose_settings

    class Scored(Runner):
        """The simulations' outcomes given by rule, so the choice alone is under test."""

        def run_all(self, jobs, tick=None):
            self.lengths += [j.steps for j in jobs]
            out = []
            for j in jobs:
                late = j.steps > self.scenario.sweep_steps
                fast_early = j.settings.get("tp") == 1
                tps = (0.8 if late else 1.2) if fast_early else 1.0 + j.settings["split"] / 1000
                out.append(
                    {"trajectories_per_s": tps, "dropped_stale_groups": 9 if fast_early and late else 0}
                )
            return out

    scenario = Scenario("t", "A800", "qwen3-14b", "r2e_gym", N_GPUS, 20, ("homogeneous-lb",))
    wl = Workload.load("r2e_gym")
    runner = Scored(scenario, wl.with_overrides(32768, prompts_per_step=4, group_size=4))
    runner.lengths = []
    settings, sweeps = choose_settings(runner, ["homogeneous-lb"])
    assert settings["homogeneous-lb"].get("tp") != 1
    confirmed = sweeps["homogeneous-lb"]["confirmed"]
    assert {c["steps"] for c in confirmed} == {20}
    assert any(c["candidate"].get("tp") == 1 and c["dropped_stale_groups"] == [9, 9, 9] for c in confirmed)
    assert set(runner.lengths) == {scenario.sweep_steps, 20}
    # A run no longer than the sweep reuses the sweep's score on the planning seed.
    runner.lengths.clear()
    settings, sweeps = choose_settings(runner, ["homogeneous-lb"], run_steps=4)
    assert settings["homogeneous-lb"]["tp"] == 1
    assert set(runner.lengths) == {scenario.sweep_steps}
