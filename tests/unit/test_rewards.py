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
