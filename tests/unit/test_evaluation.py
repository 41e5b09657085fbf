"""Held-out evaluation, its pure parts: which prompts are held out, which policy versions are
evaluated and when, and what a round reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import SettingsError
from services.common.runconfig import RunConfig
from services.scheduler.evaluation import Evaluator, Round, eval_tasks, is_eval, targets
from services.scheduler.feed import task_list


def _cfg(**eval_cfg: object) -> RunConfig:
    task = {"dataset": "expressions", "num_prompts": 200, "seed": 3}
    return RunConfig.model_validate(
        {"task": task, "training": {"steps": 5}, "eval": {"every": 2, **eval_cfg}}
    )


def _evaluator(cfg: RunConfig) -> Evaluator:
    return Evaluator(cfg.eval, cfg.task, cfg.training.steps)


def test_built_in_held_out_prompts_exclude_every_training_prompt() -> None:
    cfg = _cfg(prompts=50)
    held = eval_tasks(cfg.eval, cfg.task)
    trained = {t.question for t in task_list(cfg.task)}
    assert len(held) == 50 and not {t.question for t in held} & trained
    assert all(is_eval(t.prompt_id) for t in held)
    assert [t.question for t in eval_tasks(cfg.eval, cfg.task)] == [
        t.question for t in held
    ]  # the same every time


def test_a_file_is_read_up_to_the_prompts_asked(tmp_path: Path) -> None:
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(10)))
    tasks = eval_tasks(_cfg(prompts=4, dataset={"path": str(f)}).eval, _cfg().task)
    assert [t.question for t in tasks] == ["q0", "q1", "q2", "q3"]


def test_versions_evaluated_and_when() -> None:
    assert targets(2, 5) == [0, 2, 4, 5] and targets(0, 5) == [] and targets(10, 3) == [0, 3]
    ev = _evaluator(_cfg(prompts=2))
    assert ev.due(0) == 0
    rnd = ev.start(0, "n")
    assert ev.due(3) is None  # one round at a time
    rnd.record(1.0, [0])
    rnd.record(None, [0, 1], failure="reward_error")
    assert rnd.done and ev.finish() is rnd
    assert ev.due(1) is None and ev.due(3) == 2
    assert ev.due(5) == 5  # a version passed while a round ran is skipped: its policy is gone
    ev.done.add(5)
    assert ev.due(7) is None


def test_a_round_reports_its_mean_interval_failures_and_versions() -> None:
    rnd = Round(version=4, total=4, nonce="ab")
    assert rnd.owns(rnd.trajectory_id(3)) and not Round(4, 4, "cd").owns(rnd.trajectory_id(3))
    for reward, versions in ((1.0, [4]), (0.0, [4, 5]), (1.0, [5])):
        rnd.record(reward, versions)
    rnd.record(None, [], failure="engine_unavailable")
    s = rnd.summary(train_step=6)
    assert (s["completed"], s["failed"], s["solved"], s["policy_versions"]) == (
        3,
        {"engine_unavailable": 1},
        2,
        [4, 5],
    )
    assert (
        s["reward_mean"] == pytest.approx(2 / 3, abs=1e-4) and s["ci95"][0] < s["reward_mean"] < s["ci95"][1]
    )


def test_eval_config_errors_are_clear(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "q", "answer": 1}) + "\n")
    from services.common.runconfig import parse_run_config

    with pytest.raises(SettingsError) as err:
        parse_run_config(json.dumps({"task": {"dataset": {"path": str(f)}}, "eval": {"every": 1}}), "x")
    assert "eval.dataset is required to evaluate a task from a dataset file" in str(err.value.message)


def test_pass_at_k_against_hand_computed_values() -> None:
    from services.scheduler.evaluation import pass_at_k

    # n = 4 samples, c = 1 passes: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == pytest.approx(1.0)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # n = 5, c = 2: pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_a_round_of_several_samples_reports_pass_at_k_per_prompt() -> None:
    """Two prompts, 4 samples each: prompt 0 passes 1 of 4 (a reward of 0.1, the tool bonus, is
    not a pass), prompt 1 passes 3 of 3 (its fourth sample failed: not counted)."""
    rnd = Round(version=2, total=8, nonce="ab", samples=4, ks=(1, 2, 4), threshold=1.0)
    for i, reward in enumerate([1.1, 0.1, 0.0, 0.0, 1.0, 1.0, 1.0]):
        rnd.record(reward, [2], trajectory_id=rnd.trajectory_id(i))
    rnd.record(None, [], failure="engine_unavailable", trajectory_id=rnd.trajectory_id(7))
    s = rnd.summary(train_step=2)
    assert s["solved"] == 4 and s["samples_per_prompt"] == 4
    # pass@1 = (1/4 + 1) / 2; pass@2 = (1/2 + 1) / 2; pass@4: prompt 0 only (prompt 1 has 3 samples)
    assert s["pass_at_k"] == {"1": pytest.approx(0.625), "2": pytest.approx(0.75), "4": pytest.approx(1.0)}


def test_pass_at_k_settings_are_checked() -> None:
    from pydantic import ValidationError

    from services.common.runconfig import EvalConfig

    assert EvalConfig().ks == [1] and EvalConfig(samples=8).ks == [1, 8]
    assert EvalConfig(samples=8, pass_at_k=[4, 1, 4]).ks == [1, 4]
    with pytest.raises(ValidationError, match="between 1 and eval.samples"):
        EvalConfig(samples=4, pass_at_k=[8])
