"""The job report counts each train step once, however the trainer announced the end, and lists
what each role change cost."""

from pathlib import Path
from typing import Any

import pytest

from services.common.contracts import ev
from tools.report import per_step


def _m(step: int, done: bool = False, reward: float = 0.0) -> ev.TrainMetrics:
    return ev.TrainMetrics(step=step, weight_version=step, reward_mean=reward, done=done)


def test_done_on_the_last_step_counts_that_step() -> None:
    steps = per_step([_m(1, reward=0.1), _m(2, done=True, reward=0.2)])
    assert [m.step for m in steps] == [1, 2]
    assert [m.reward_mean for m in steps] == [0.1, 0.2]


def test_separate_done_message_is_not_a_new_step() -> None:
    steps = per_step([_m(1), _m(2, reward=0.5), _m(2, done=True, reward=0.5)])
    assert [m.step for m in steps] == [1, 2]


def test_out_of_order_and_step_zero() -> None:
    assert [m.step for m in per_step([_m(2), _m(0, done=True), _m(1)])] == [1, 2]


def test_steps_past_the_committed_one_are_not_reported() -> None:
    """A forged metrics message for a step the trainer never committed is not a step of the report."""
    steps = per_step([_m(1), _m(2), _m(9, done=True, reward=1.0)], committed_step=2)
    assert [m.step for m in steps] == [1, 2]


def test_role_changes_carry_what_each_move_cost() -> None:
    from tools.report import role_changes

    history = [
        {"worker": "e0", "from": "rollout", "to": "hybrid", "at": 100.0},
        {"worker": "e0", "state": "drained", "seconds": 0.1, "at": 100.1},
        {"worker": "e0", "state": "fetched", "seconds": 2.0, "at": 102.1},
        {"worker": "e0", "state": "failed", "seconds": 60.0, "at": 162.1},
        {"worker": "e1", "from": "rollout", "to": "draining", "at": 150.0},
        {"worker": "e0", "state": "joined", "seconds": 0.5, "at": 163.0},
        {"worker": "e0", "from": "hybrid", "to": "rollout", "at": 200.0},
        {"worker": "e1", "from": "draining", "to": "rollout", "bucket": "long", "at": 201.0},
        {"worker": "e0", "state": "released", "seconds": 37.0, "at": 204.5},
        {"worker": "e2", "state": "joined", "seconds": 1.0, "at": 205.0},  # no change of its: ignored
    ]
    out = role_changes(history)
    assert [(c["worker"], c["from"], c["to"], c["seconds"]) for c in out] == [
        ("e0", "rollout", "hybrid", 63.0),  # until it joined, one failed attempt included
        ("e1", "rollout", "draining", None),  # its drain was never reported
        ("e0", "hybrid", "rollout", 4.5),
        ("e1", "draining", "rollout", 0.0),  # complete with the plan
    ]
    assert out[0]["steps"] == {"drained": 0.1, "fetched": 2.0, "joined": 0.5} and out[0]["failures"] == 1
    assert out[2]["steps"] == {"released": 37.0}


def test_a_relayout_keeps_why_bucket_and_tp_and_a_spare_is_done_when_drained() -> None:
    from tools.report import role_changes

    history = [
        {
            "worker": "e0",
            "from": "rollout",
            "to": "rollout",
            "bucket": "long",
            "tp": 4,
            "why": "relayout",
            "at": 1.0,
        },
        {
            "worker": "e1",
            "from": "rollout",
            "to": "spare",
            "bucket": "",
            "tp": 2,
            "why": "relayout",
            "at": 1.0,
        },
        {"worker": "e1", "state": "drained", "seconds": 0.2, "turns_handed_back": 3, "at": 1.5},
    ]
    out = role_changes(history)
    assert [(c["worker"], c["why"], c["bucket"], c["tp"], c["seconds"]) for c in out] == [
        ("e0", "relayout", "long", 4, 0.0),  # complete with the plan
        ("e1", "relayout", "", 2, 0.5),  # once it handed its turns back
    ]
    assert out[1]["turns_handed_back"] == 3


def test_reward_windows_pool_the_steps_trajectories_with_a_t_interval() -> None:
    import math
    import statistics

    from tools.report import learning_report, reward_window
    from tools.sim.stats import mean_ci

    steps_rewards = [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 0.1, 0.0], [1.0, 1.0, 1.1]]
    metrics = [
        ev.TrainMetrics(
            step=i + 1,
            sampled_reward_mean=statistics.fmean(rs),
            sampled_reward_std=statistics.pstdev(rs),
            sampled_trajectories=len(rs),
            reward_mean=0.5,
            trajectories=2,
            logprob_mismatch=math.nan if i == 0 else 1e-6,
            policy_versions=[i],
        )
        for i, rs in enumerate(steps_rewards)
    ]
    pooled = [r for rs in steps_rewards for r in rs]
    mean, (lo, hi) = mean_ci(pooled)
    w = reward_window(metrics)
    assert w is not None and w["trajectories"] == len(pooled)
    assert w["mean"] == pytest.approx(mean, abs=1e-4)
    assert w["ci95"] == pytest.approx([lo, hi], abs=1e-4)
    assert reward_window([]) is None
    report = learning_report(metrics)
    assert report["reward_mean_per_step"] == pytest.approx([0.5, 0.5167, 1.0333], abs=1e-4)
    assert report["logprob_mismatch_per_step"] == [None, 1e-6, 1e-6]  # NaN: no token to compare
    assert report["policy_versions_per_step"] == [[0], [1], [2]]
    assert report["reward_last3"] == report["reward_first3"]
    # a step without the sampled figures (an older trainer) falls back to the trained ones
    assert learning_report([ev.TrainMetrics(step=1, reward_mean=0.25, trajectories=4)])[
        "reward_mean_per_step"
    ] == [0.25]


def test_steps_that_changed_no_weight_are_counted_and_warned_about() -> None:
    from tools.report import learning_report

    steps = [ev.TrainMetrics(step=i + 1, groups_informative=g) for i, g in enumerate([2, 0, 1, 0])]
    report = learning_report(steps)
    assert report["groups_informative_per_step"] == [2, 0, 1, 0] and report["steps_without_update"] == 2
    assert report["warnings"] and "2 of 4 train steps" in report["warnings"][0]
    assert learning_report(steps[:1])["warnings"] == []
    # zero-advantage groups trained anyway: the optimizer still stepped (weight decay, momentum)
    kept = learning_report(steps, filtered=False)["warnings"][0]
    assert "no policy gradient" in kept and "changed no weight" not in kept


def test_a_report_with_steps_gets_a_reward_plot(tmp_path) -> None:
    from tools.learning_plot import write_reward_plot
    from tools.report import learning_report

    metrics = [
        ev.TrainMetrics(
            step=i + 1, sampled_reward_mean=0.1 * i, sampled_reward_std=0.05, sampled_trajectories=16
        )
        for i in range(5)
    ]
    report = {"run_id": "r", **learning_report(metrics)}
    path = write_reward_plot(report, tmp_path)
    assert path is not None and path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    assert write_reward_plot({"reward_mean_per_step": []}, tmp_path / "none") is None
    short = {"reward_mean_per_step": [0.2], "training_stats": {"entropy": [None]}}  # one step
    (tmp_path / "short").mkdir()
    assert write_reward_plot(short, tmp_path / "short") is not None  # says in the panel why it is empty


def test_the_report_says_what_its_reward_measures() -> None:
    from services.common.runconfig import TaskConfig
    from tools.report import reward_definition

    assert reward_definition(TaskConfig(dataset="expressions", tool_bonus=0.0)) == (
        "expressions: 1 for the right number, 0 otherwise (task success)"
    )
    assert reward_definition(TaskConfig()).endswith("+ 0.1 when a tool call succeeded")
    assert reward_definition(TaskConfig(dataset="synthetic", workload="r2e_gym")).startswith("synthetic")


def test_libra_report_reprints_a_runs_summary(tmp_path, capsys, monkeypatch) -> None:
    import json

    from tools.cli import main

    run = tmp_path / "r1"
    run.mkdir()
    report = {
        "status": "completed",
        "wall_s": 12.5,
        "trajectories_completed": 8,
        "trajectories_per_s": 0.64,
        "train_steps": 2,
        "final_weight_version": 2,
        "reward": "expressions: 1 for the right number, 0 otherwise (task success)",
        "reward_mean_per_step": [0.5, 0.75],
        "reward_first3": {"mean": 0.625, "ci95": [0.2, 1.0], "trajectories": 8},
        "policy_versions_per_step": [[0], [0, 1]],
        "logprob_mismatch_per_step": [1e-6, 2e-6],
        "tool_calls": {"ok": 3},
        "trajectories_failed_by_code": {"reward_error": 1},
        "engines": [{"id": "rollout-engine-0", "weight_version": 2}],
        "all_engines_on_final_version": True,
    }
    (run / "report.json").write_text(json.dumps(report))
    assert main(["report", "r1", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reward                   expressions: 1 for the right number" in out
    assert "reward_first3            0.625 (95% CI 0.2 .. 1.0, 8 trajectories)" in out
    assert "trajectories_failed      {'reward_error': 1}" in out and f"report: {run / 'report.json'}" in out
    assert (
        "policy_versions_per_step [0], [0, 1]" in out and "logprob_mismatch         1.0e-06, 2.0e-06\n" in out
    )
    report["logprob_mismatch_per_step"] = [1e-6, None]  # no token at the trainer's weights in step 2
    report["policy_versions_per_step"] = [[0], []]
    (run / "report.json").write_text(json.dumps(report))
    assert main(["report", "r1", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("logprob_mismatch")]
    assert line.startswith("logprob_mismatch         1.0e-06, – (–: no token") and "None" not in line
    assert "policy_versions_per_step [0], –" in out
    report["status"] = "timed_out"
    (run / "report.json").write_text(json.dumps(report))
    assert main(["report", "r1", "--runs-dir", str(tmp_path)]) == 1
    assert main(["report", "missing", "--runs-dir", str(tmp_path)]) == 2
    # the flag `libra run` writes with is the one every reader takes (the old name still works)
    assert main(["report", "r1", "--output-dir", str(tmp_path)]) == 1
    capsys.readouterr()
    # without the flag: where the last `libra run` started in this directory wrote, then ./runs
    from tools.run_dirs import remember_runs_dir

    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["report", "r1"]) == 2
    assert f"looked in {Path('runs') / 'r1'}" in capsys.readouterr().err
    remember_runs_dir(tmp_path)
    assert main(["report", "r1"]) == 1  # found: it timed out
    assert f"report: {run / 'report.json'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out.startswith("libra ")


def test_a_timeline_gets_throughput_tool_and_engine_plots(tmp_path) -> None:
    from tools.run_plots import write_run_plots

    samples = [
        {
            "t": float(t),
            "completed": 2 * t,
            "in_flight": 4,
            "failed": 0,
            "turns": 3 * t,
            "tool_calls": {"ok": t, "error": t // 3},
        }
        for t in range(60)
    ]
    engines = [
        {
            "t": float(t),
            "engine": f"rollout-engine-{e}",
            "running": (t + e) % 9,
            "waiting": 0,
            "capacity": 8,
            "tokens_per_s": 10.0 + e,
        }
        for t in range(60)
        for e in range(2)
    ]
    steps = [{"t": 20.0 * i, "step": i, "step_s": 15.0, "push_s": 2.0} for i in (1, 2)]
    paths = write_run_plots({"samples": samples, "engines": engines, "steps": steps}, "r", tmp_path)
    assert sorted(p.name for p in paths) == ["engines.png", "throughput.png", "tools.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 10_000 for p in paths)
    assert write_run_plots({"samples": [], "engines": [], "steps": []}, "r", tmp_path / "none") == []
    early = write_run_plots(
        {"samples": samples[:5], "engines": engines, "steps": []}, "r", tmp_path / "early"
    )
    assert "throughput.png" in {p.name for p in early}  # before the first step: rollout alone


def test_a_fleet_too_large_for_a_line_each_is_drawn_as_its_spread_and_total(tmp_path) -> None:
    from tools.run_plots import FLEET_BINS, MAX_ENGINE_LINES, _fleet, write_run_plots

    def load(t: float, e: int, running: int, rate: float) -> dict[str, Any]:
        return {
            "t": t,
            "engine": f"e{e}",
            "running": running,
            "waiting": 0,
            "capacity": 4,
            "tokens_per_s": rate,
        }

    # reports come on change: e0 busy from 0 s, idle from 50 s; e1 reports only from 60 s, at 100 s
    by_engine = {
        "e0": [load(0.0, 0, 4, 10.0), load(50.0, 0, 0, 0.0)],
        "e1": [load(60.0, 1, 2, 5.0), load(100.0, 1, 2, 5.0)],
    }
    grid, util, total = _fleet(by_engine)
    assert len(grid) == FLEET_BINS and grid[0] == 0.0 and grid[-1] == 100.0
    at = {round(t): (u, tot) for t, u, tot in zip(grid, util, total, strict=True)}
    assert at[0] == ([1.0], 10.0)  # e1 has not reported yet: not counted as idle
    assert at[100] == ([0.0, 0.5], 5.0)  # e0's last report carried forward
    many = [load(float(t), e, (t + e) % 5, 1.0) for t in range(30) for e in range(MAX_ENGINE_LINES + 1)]
    (png,) = [
        p
        for p in write_run_plots({"samples": [], "engines": many, "steps": []}, "r", tmp_path)
        if p.name == "engines.png"
    ]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_speculation_totals_survive_an_engine_restart_and_split_by_step() -> None:
    from tools.job_watch import SpecTotals, speculation_report

    t = SpecTotals()
    t.update(
        ev.EngineLoad(engine_id="e0", spec_verify_steps=10, spec_drafted_tokens=40, spec_accepted_tokens=20)
    )
    t.update(
        ev.EngineLoad(engine_id="e1", spec_verify_steps=5, spec_drafted_tokens=20, spec_accepted_tokens=5)
    )
    first = t.totals()
    assert first == [15, 60, 25]
    t.update(
        ev.EngineLoad(engine_id="e0", spec_verify_steps=2, spec_drafted_tokens=8, spec_accepted_tokens=8)
    )
    assert t.totals() == [17, 68, 33]  # e0 restarted: its earlier counts are kept
    report = speculation_report(t.totals(), [first, t.totals()])
    assert report["acceptance_rate"] == round(33 / 68, 4) and report["mean_accepted"] == round(33 / 17, 3)
    assert report["acceptance_rate_per_step"] == [round(25 / 60, 4), 1.0]
    assert report["mean_accepted_per_step"] == [round(25 / 15, 3), 4.0]
    assert speculation_report([0, 0, 0], [[0, 0, 0]])["acceptance_rate_per_step"] == [None]


def test_lending_reports_the_trainers_counts_and_the_turns_its_engines_handed_back() -> None:
    from services.common.runconfig import RunConfig
    from tools.report import lending_report, role_changes

    history = [
        {"worker": "e2", "from": "parked", "to": "lent", "at": 10.0},
        {"worker": "e2", "from": "lent", "to": "parked", "at": 30.0},
        {"worker": "e2", "state": "parked", "seconds": 0.01, "turns_handed_back": 3, "at": 30.2},
        {"worker": "e2", "from": "parked", "to": "lent", "at": 40.0},
        {"worker": "e2", "from": "lent", "to": "parked", "at": 50.0},
        {"worker": "e2", "state": "parked", "seconds": 0.01, "turns_handed_back": 1, "at": 50.1},
    ]
    changes = role_changes(history)
    assert [c["seconds"] for c in changes] == [0.0, 0.2, 0.0, 0.1]  # parked: once it said so
    steps = [ev.TrainMetrics(step=1, lends=1, reclaims=1, seconds_lent=20.0)]
    steps.append(ev.TrainMetrics(step=2, lends=2, reclaims=2, early_reclaims=1, seconds_lent=30.0))
    off = RunConfig()
    assert lending_report(off, steps, changes) is None
    on = RunConfig.model_validate({"planner": {"lending": {"engines": 2, "tensor_parallel": 4}}})
    assert lending_report(on, steps, changes) == {
        "engines": 2,
        "lends": 2,
        "reclaims": 2,
        "early_reclaims": 1,
        "policy": "always",
        "seconds_lent": 30.0,
        "turns_moved": 4,
        "turns_served_by_trainer": None,
    }
    assert lending_report(on, [], {"error": "no history"})["turns_moved"] is None
    own = RunConfig.model_validate(
        {"rollout": {"backend": "hf"}, "planner": {"lending": {"engines": 1, "trainer_serves": True}}}
    )
    steps.append(ev.TrainMetrics(step=3, lends=3, reclaims=3, lent_turns_answered=7))
    assert lending_report(own, steps, changes)["turns_served_by_trainer"] == 7


def test_lent_engines_serve_the_bucket_of_the_nearest_tp() -> None:
    from pydantic import ValidationError

    from services.common.runconfig import RunConfig

    def cfg(**lending: object) -> RunConfig:
        buckets = [
            {"name": "short", "tensor_parallel": 1, "max_output_tokens": 100},
            {"name": "mid", "tensor_parallel": 2, "max_output_tokens": 1000},
            {"name": "long", "tensor_parallel": 8},
        ]
        return RunConfig.model_validate(
            {"rollout": {"engines": 3, "buckets": buckets}, "planner": {"lending": {"engines": 1, **lending}}}
        )

    assert cfg(tensor_parallel=4).lending_bucket == "mid"  # log2 4 is as near 2 as 8: the smaller
    assert cfg(tensor_parallel=8).lending_bucket == "long"
    assert cfg(tensor_parallel=1).lending_bucket == "short"
    assert cfg(tensor_parallel=8, bucket="short").lending_bucket == "short"
    assert cfg().engines_needed == 4
    with pytest.raises(ValidationError, match="planner.lending.bucket"):
        cfg(bucket="nowhere")


def test_the_trainer_serves_only_as_one_hf_engine_on_its_own_unsharded_model() -> None:
    from pydantic import ValidationError

    from services.common.runconfig import RunConfig

    def cfg(engines: int = 1, **sections: object) -> RunConfig:
        data: dict[str, object] = {
            "rollout": {"engines": 2, "backend": "hf"},
            "planner": {"lending": {"engines": engines, "trainer_serves": True}},
            **sections,
        }
        return RunConfig.model_validate(data)

    assert cfg().engines_needed == 2  # the trainer is the lent engine: no process stands for it
    for bad in (
        {"engines": 2},
        {"rollout": {"engines": 2, "backend": "emulated"}},
        {"training": {"backend": "emulated"}},
        {"training": {"fsdp": 2}},
    ):
        with pytest.raises(ValidationError, match="trainer_serves"):
            cfg(**bad)  # type: ignore[arg-type]
