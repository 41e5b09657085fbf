"""reasoning-gym datasets as tasks with their own scorers, and the math_verify reward — run with the
real packages (the `environments` extra), in real reward worker processes."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from services.common.config import ConfigFileError
from services.common.runconfig import ReasoningGymDataset, RunConfig, TaskConfig
from services.scheduler.datasets import DatasetError
from services.scheduler.feed import task_list
from services.scheduler.gym_tasks import gym_tasks, math_verify_score, reasoning_gym_score
from services.scheduler.rewards import Scorer, check_reward, reward_ref
from tools.runner import check_installed

pytestmark = pytest.mark.integration

CHAIN = {"reasoning_gym": "chain_sum", "size": 6, "seed": 3, "config": {"min_terms": 2, "max_terms": 2}}


def test_a_reasoning_gym_task_is_its_samples_with_the_prompt_it_asks_for() -> None:
    task = TaskConfig(dataset=CHAIN)
    tasks = task_list(task)
    assert len(tasks) == 6 and len({t.prompt_id for t in tasks}) == 6
    first = tasks[0]
    assert first.messages is not None and first.messages[0]["role"] == "system"
    assert "<answer>" in first.messages[0]["content"] and first.messages[1]["content"] == first.question
    assert first.sample is not None and first.sample["reasoning_gym"]["name"] == "chain_sum"
    again = gym_tasks(ReasoningGymDataset.model_validate(CHAIN))
    assert [t.question for t in again] == [t.question for t in tasks]  # the seed fixes the samples
    assert reward_ref(task) == "reasoning_gym"
    assert len(task_list(TaskConfig(dataset=CHAIN, num_prompts=2))) == 2


def test_worked_examples_are_the_tasks_own_samples_answered_in_tags() -> None:
    (t, *_) = task_list(TaskConfig(dataset={**CHAIN, "examples": 2}))
    assert t.messages is not None
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    questions = {u.question for u in task_list(TaskConfig(dataset=CHAIN))}
    shots = t.messages[1:-1]
    assert shots[1]["content"].startswith("<answer>") and shots[1]["content"].endswith("</answer>")
    assert not {shots[0]["content"], shots[2]["content"]} & questions  # drawn with another seed


def test_its_own_scorer_scores_the_answer_tag() -> None:
    (t, *_) = task_list(TaskConfig(dataset=CHAIN))
    assert t.sample is not None
    assert reasoning_gym_score(f"Adding up. <answer>{t.answer}</answer>", t.sample, {}) == 1.0
    assert reasoning_gym_score("<answer>-99999</answer>", t.sample, {}) < 1.0
    assert reasoning_gym_score(f"It is {t.answer}.", t.sample, {}) == 0.0  # no tag, no answer


def test_math_verify_finds_equal_answers_written_differently() -> None:
    assert math_verify_score("so the answer is $\\frac{1}{2}$", {}, {}, answer="0.5") == 1.0
    assert math_verify_score("\\boxed{2\\sqrt{2}}", {"answer": "\\sqrt{8}"}, {}) == 1.0
    assert math_verify_score("\\boxed{3}", {}, {}, answer="0.5") == 0.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"reasoning_gym": "no_such_task"}, "'no_such_task'"),
        ({"reasoning_gym": "chain_sum", "config": {"min_termz": 2}}, "min_termz"),
    ],
)
def test_a_task_that_cannot_be_made_is_a_dataset_error(spec: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        task_list(TaskConfig(dataset=spec))


def test_the_gym_reward_needs_a_gym_task() -> None:
    with pytest.raises(ValueError, match="reward reasoning_gym scores a reasoning-gym task"):
        TaskConfig(reward="reasoning_gym")
    with pytest.raises(ValueError, match="eval.dataset is required"):
        RunConfig.model_validate({"task": {"dataset": CHAIN}, "eval": {"every": 1}})


def test_a_missing_extra_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a)
    )
    cfg = RunConfig.model_validate({"model": {"source": "tiny-random"}, "task": {"reward": "math_verify"}})
    with pytest.raises(ConfigFileError) as err:
        check_installed(cfg)
    assert "task.reward: math_verify needs math-verify (the `environments` extra" in err.value.message


async def test_the_built_in_scorers_run_in_reward_workers() -> None:
    task = TaskConfig(dataset=CHAIN, reward_workers=1)
    (t, *_) = task_list(task)
    assert t.sample is not None
    await check_reward(task, t.sample, t.answer)  # loads and calls it as the scheduler will
    scorer = Scorer(task, "reasoning_gym")
    await scorer.start()
    try:
        right = await scorer.score(f"<answer>{t.answer}</answer>", t.answer, t.sample, {})
        wrong = await scorer.score("<answer>nope</answer>", t.answer, t.sample, {})
        assert (right, wrong) == (1.0, 0.0)
    finally:
        await scorer.close()
    maths = Scorer(TaskConfig(reward="math_verify", reward_workers=1), "math_verify")
    await maths.start()
    try:
        scores = await asyncio.gather(
            maths.score("$\\frac{84}{2}$", "42", {"answer": "42"}, {}), maths.score("41", "42", {}, {})
        )
        assert scores == [1.0, 0.0]
    finally:
        await maths.close()
