"""Rewards by config: the built-in matchers, and `module:function` rewards run in real worker
processes, where one that raises, hangs, crashes or returns nonsense fails only its own call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.scheduler.plugins import PluginFailure, PluginLoadError
from services.scheduler.rewards import RewardPool, exact_match, numeric

PLUGIN = """
import os, sys, time

def score(response, sample, trajectory):
    mode = sample.get("mode", "ok")
    print("noise on stdout must not break the protocol")
    if mode == "raise":
        raise ValueError("no good")
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        os._exit(3)
    if mode == "text":
        return "high"
    if mode == "nan":
        return float("nan")
    if mode == "dict":
        return {"score": 0.5, "extra": 1}
    return len(response) + len(trajectory["turns"]) + sample["bonus"]
"""


def test_builtins() -> None:
    assert exact_match("so <answer> Paris </answer>", "Paris") == 1.0
    assert exact_match("Paris", " Paris") == 1.0
    assert exact_match("<answer>paris</answer>", "Paris") == 0.0
    assert numeric("<answer>1,200.0</answer>", "1200") == 1.0
    assert numeric("it is 41, no, 42", 42) == 1.0
    assert numeric("<answer>43</answer>", 42) == 0.0
    assert numeric("<answer>blue</answer>", "blue") == 1.0  # not a number: exact match


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_reward.py").write_text(PLUGIN)
    return tmp_path


def test_every_failure_is_typed_and_the_pool_keeps_serving(plugin_dir: Path) -> None:
    async def main() -> list[float | PluginFailure]:
        pool = RewardPool("my_reward:score", [str(plugin_dir)], workers=1, timeout_s=2.0)
        await pool.start()
        try:
            out = []
            for mode in ["ok", "raise", "hang", "ok", "exit", "ok", "text", "nan", "dict"]:
                out.append(
                    await pool.score(
                        response="abc",
                        sample={"mode": mode, "bonus": 0.25},
                        trajectory={"turns": ["x", "abc"]},
                    )
                )
            return out
        finally:
            await pool.close()

    out = asyncio.run(main())
    codes = [r.code if isinstance(r, PluginFailure) else r for r in out]
    assert codes == [
        5.25,
        "reward_error",
        "reward_timeout",
        5.25,  # the hung worker was killed and replaced
        "reward_crashed",
        5.25,
        "reward_invalid",
        "reward_invalid",
        0.5,
    ]
    assert isinstance(out[1], PluginFailure) and "ValueError: no good" in out[1].message


def test_calls_run_concurrently_across_workers(plugin_dir: Path) -> None:
    async def main() -> list[float | PluginFailure]:
        pool = RewardPool("my_reward:score", [str(plugin_dir)], workers=2, timeout_s=1.0)
        await pool.start()
        try:
            # one hangs until its timeout; the other worker answers the rest meanwhile
            calls = [pool.score(response="", sample={"mode": "hang"}, trajectory={"turns": []})]
            calls += [
                pool.score(response="a", sample={"bonus": i}, trajectory={"turns": []}) for i in range(4)
            ]
            return await asyncio.gather(*calls)
        finally:
            await pool.close()

    out = asyncio.run(main())
    assert isinstance(out[0], PluginFailure) and out[0].code == "reward_timeout"
    assert out[1:] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nowhere_module:score", "ModuleNotFoundError"),
        ("my_reward:missing", "AttributeError"),
        ("my_reward:os", "not a function"),
    ],
)
def test_a_reward_that_cannot_load_is_refused_at_start(plugin_dir: Path, ref: str, message: str) -> None:
    async def main() -> None:
        pool = RewardPool(ref, [str(plugin_dir)], workers=1, timeout_s=5.0)
        try:
            await pool.start()
        finally:
            await pool.close()

    with pytest.raises(PluginLoadError, match=message):
        asyncio.run(main())


def test_code_blocks_and_tests_are_read_from_the_response_and_row() -> None:
    from services.scheduler.rewards import code_block, tests_of

    assert code_block("a\n```python\nx = 1\n```\nthen\n```py\ny = 2\n```") == "y = 2"
    assert code_block("```python\nprint(1)") == "print(1)"  # cut by the token budget
    assert code_block("no code") is None and code_block("```python\n\n```") is None
    assert tests_of({"tests": ["assert f(1)", "assert f(2)"]}) == "assert f(1)\nassert f(2)"
    assert tests_of({"tests": "assert f(1)"}) == "assert f(1)"
    assert isinstance(tests_of({"tests": ""}), PluginFailure) and isinstance(tests_of({}), PluginFailure)


def test_config_check_calls_the_reward_as_the_scheduler_will_and_names_what_is_wrong(tmp_path: Path) -> None:
    """A reward with the wrong signature loads fine; the trial call on the dataset's first row
    catches it before the job starts, with the exception and where it was raised."""
    from services.common.runconfig import TaskConfig
    from services.scheduler.rewards import check_reward

    (tmp_path / "wrong.py").write_text(
        "def score(text):\n    return 1.0\n\ndef picky(response, sample, trajectory):\n"
        "    return float(sample['gold'])\n\ndef fine(response, sample, trajectory):\n    return 0.0\n"
    )
    row = {"prompt_id": "p0", "question": "2+2?", "answer": "4"}

    def task(ref: str) -> TaskConfig:
        return TaskConfig(reward=ref, plugin_paths=[str(tmp_path)])

    with pytest.raises(PluginLoadError, match="unexpected keyword argument 'response'"):
        asyncio.run(check_reward(task("wrong:score"), row))
    with pytest.raises(PluginLoadError, match=r"KeyError: 'gold' \(at wrong.py:5 in picky\)"):
        asyncio.run(check_reward(task("wrong:picky"), row))
    asyncio.run(check_reward(task("wrong:fine"), row))
    asyncio.run(check_reward(task("wrong:score")))  # without a sample: loading only, as before


def test_a_reward_failing_on_nearly_every_call_is_called_broken_and_one_failing_sometimes_is_not() -> None:
    from services.scheduler.user_code import BrokenUserCode

    broken = BrokenUserCode(window=4, share=0.75)
    assert broken.ended("reward_error", "TypeError: x") is None
    assert broken.ended("stale", "too old") is None  # the infrastructure's failures count neither way
    assert broken.ended() is None
    assert broken.ended("reward_error", "TypeError: x") is None  # 2 of the last 3: too few yet
    why = broken.ended("reward_error", "TypeError: y")
    assert why is not None and "3 of the last 4" in why and "reward_error" in why and "TypeError: y" in why
    assert "3 of 4 since the job started" in why  # the stale one is the infrastructure's
    moody = BrokenUserCode(window=4, share=0.75)
    for _ in range(10):  # fails half the time: unlucky, not broken
        assert moody.ended("reward_error", "e") is None
        assert moody.ended() is None
    mixed = BrokenUserCode(window=3, share=1.0)
    assert [mixed.ended(c, "m") for c in ("reward_error", "env_error")] == [None, None]
    assert "3 of the last 3" in (mixed.ended("env_timeout", "slow") or "")


def test_the_soft_overlong_penalty_against_hand_computed_values() -> None:
    """DAPO's eq. 13 with limit 100, buffer 20, factor 1 (and 0.5): nothing up to 80 tokens, a
    linear ramp to -factor at 100, -factor beyond."""
    from services.scheduler.rewards import overlong_penalty

    assert overlong_penalty(50, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(85, 100, 20, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(140, 100, 20, 1.0) == pytest.approx(-1.0)


def test_the_overlong_limit_defaults_to_the_trajectory_budget_and_the_buffer_must_fit() -> None:
    from pydantic import ValidationError

    from services.common.runconfig import TaskConfig

    task = TaskConfig.model_validate({"max_new_tokens": 64, "max_turns": 2})
    assert task.overlong_limit == 128 and not task.overlong.filter and task.overlong.soft_penalty is None
    one = TaskConfig.model_validate(
        {"max_new_tokens": 64, "max_turns": 1, "overlong": {"soft_penalty": {"length": 16}}}
    )
    assert one.overlong_limit == 64 and one.overlong.soft_penalty is not None
    assert one.overlong.soft_penalty.factor == 1.0
    with pytest.raises(ValidationError, match="exceeds the limit"):
        TaskConfig.model_validate(
            {"max_new_tokens": 8, "max_turns": 1, "overlong": {"soft_penalty": {"length": 16}}}
        )
