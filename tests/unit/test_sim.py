import json
from collections import Counter

import pytest

from services.planner.search import BucketPlan, Plan
from tools.sim.cli import main
from tools.sim.ledger import CATEGORIES
from tools.sim.runner import load_presets
from tools.sim.simulator import Simulator
from tools.sim.systems import SYSTEMS, Env, _libra, build
from tools.sim.workload import Workload

N_GPUS = 16
STEPS = 3


@pytest.fixture(scope="module")
def env() -> Env:
    wl = Workload.load("r2e_gym")
    small = Workload({**wl.spec, "prompts_per_step": 4, "group_size": 4})
    return Env(load_presets("A800", "qwen3-14b"), small, N_GPUS, plan_steps=0)


def _system(name: str, env: Env):
    if name in ("libra", "libra-no-ehp", "libra-no-cmlfq"):
        # An allocation with every mechanism present: three buckets and a hybrid pool.
        plan = Plan(
            4,
            1,
            [
                BucketPlan("short", 1, 2, 3000),
                BucketPlan("medium", 2, 1, 9000),
                BucketPlan("long", 4, 1, float("inf")),
            ],
            hybrid_gpus=4,
        )
        if name == "libra-no-ehp":
            plan.hybrid_gpus, plan.train_gpus = 0, 8
        return _libra(env, name, plan, routing="pooled" if name == "libra-no-cmlfq" else "cmlfq")
    settings = {"colocated-sync": {"tp": 2}, "libra-no-grp": {"split": 8}}.get(name, {"split": 8, "tp": 2})
    return build(name, env, **settings)


def _run(name: str, env: Env) -> tuple[Simulator, Counter, set]:
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
    sim = Simulator(system, env.workload, env.cm, N_GPUS, STEPS, seed=3)
    sim.run()
    return sim, finished, admitted


@pytest.mark.parametrize("name", SYSTEMS)
def test_every_trajectory_finishes_exactly_once_and_gpu_time_adds_up(env, name):
    sim, finished, admitted = _run(name, env)
    per_step = env.workload.prompts_per_step * env.workload.group_size
    assert sim.version == STEPS
    assert sum(sim.step_trajs) == STEPS * per_step
    assert max(finished.values()) == 1
    assert set(finished) <= admitted
    assert admitted - set(finished) == set(sim.trajs)  # the rest are still in flight
    assert sim.finished == len(finished)
    assert sim.ledger.total() == pytest.approx(N_GPUS * sim.now, rel=1e-6)
    assert all(v >= -1e-6 for v in sim.ledger.totals.values())
    assert set(sim.ledger.totals) <= set(CATEGORIES)


def test_hybrid_workers_join_training_and_come_back(env):
    sim, _, _ = _run("libra", env)
    assert sim.pool is not None
    roles = Counter(r.value for w in sim.pool.workers.values() for _, r in w.history)
    assert roles["active"] >= 1 and roles["rollout"] >= 1
    assert sim.ledger.totals["train_busy"] > 0


def test_same_seed_same_result_and_same_workload_across_systems(env):
    a, _, _ = _run("homogeneous-lb", env)
    b, _, _ = _run("homogeneous-lb", env)
    assert a.step_ends == b.step_ends
    c, _, _ = _run("disaggregated-static", env)
    assert a.step_tokens[0] == c.step_tokens[0]  # group k is the same draw in every system


def test_cli_runs_a_workload_file_and_writes_results(tmp_path):
    out = tmp_path / "out"
    rc = main(["--workload", "search_r1", "--gpus", "16", "--systems", "libra,homogeneous-lb",
               "--steps", "2", "--out", str(out), "--no-plots"])  # fmt: skip
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"libra", "homogeneous-lb"}
    for r in results["systems"].values():
        assert r["trajectories_per_s"] > 0
        assert len(r["step_times_s"]) == 2
        assert r["gpu_seconds_accounted"] == pytest.approx(r["gpu_seconds_total"], rel=1e-6)
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


def test_unknown_system_exits_2(tmp_path, capsys):
    rc = main(["--workload", "r2e_gym", "--systems", "nope", "--out", str(tmp_path), "--no-plots"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err
