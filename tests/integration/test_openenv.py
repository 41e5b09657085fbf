"""An OpenEnv environment, written against OpenEnv's own API and left unchanged, plays Libra's
episodes: in the environment workers (`environment_args.env`), and as a running OpenEnv server
(`uvicorn`) over its WebSocket sessions (`environment_args.url`); bad arguments fail typed."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from services.common.localstack import free_port
from services.scheduler.environment import EnvPool, Step, check_environment
from services.scheduler.openenv_env import OpenEnv
from services.scheduler.plugins import PluginFailure, PluginLoadError

ADAPTER = "services.scheduler.openenv_env:OpenEnv"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def game_dir() -> Path:
    """examples/openenv: a number-guessing game written against OpenEnv's API."""
    return ROOT / "examples" / "openenv"


@pytest.fixture(scope="module")
def server(game_dir: Path) -> Iterator[str]:
    """The game as OpenEnv serves it: `uvicorn guess_game:app`, a process of its own."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "guess_game:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=game_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            raise RuntimeError("the OpenEnv server never answered /health")
        yield url
    finally:
        proc.kill()
        proc.wait()


async def play(pool: EnvPool, trajectory_id: str, sample: dict[str, Any]) -> tuple[Any, list[Step]]:
    """An episode played by halving the range: the model's turns as text, as a model would write."""
    prompt = await pool.reset(trajectory_id, sample)
    low, high, steps = 1, 20, []
    for _ in range(6):
        guess = (low + high) // 2
        step = await pool.step(trajectory_id, f"I guess {guess}")
        assert not isinstance(step, PluginFailure), step
        steps.append(step)
        if step.done:
            break
        low, high = (guess + 1, high) if "higher" in step.observation else (low, guess - 1)
    return prompt, steps


@pytest.mark.parametrize("where", ["in_process", "server"])
async def test_an_openenv_environment_plays_episodes_unchanged(
    where: str, game_dir: Path, request: pytest.FixtureRequest
) -> None:
    args = (
        {"env": "guess_game:GuessNumber"}
        if where == "in_process"
        else {"url": request.getfixturevalue("server")}
    )
    pool = EnvPool(ADAPTER, [str(game_dir)], workers=1, timeout_s=30.0, args=args)
    await pool.start()
    try:
        prompt, steps = await play(pool, "t0", {"seed": 3, "system": "Answer with a number."})
        assert prompt == [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "Guess my number from 1 to 20 in 6 turns."},
        ]
        secret = random.Random(3).randint(1, 20)
        assert steps[-1] == Step(done=True, reward=1.0)  # the sum of its steps' rewards
        assert all(s.observation.endswith(("higher.", "lower.")) for s in steps[:-1])
        assert f"{secret}:" not in "".join(s.observation for s in steps)
        # another episode, another seed, interleaved with a third: each keeps its own state
        await pool.reset("t1", {"seed": 11})
        other = await pool.step("t1", "no idea")
        assert other == Step(observation="No number there.")
        _, again = await play(pool, "t2", {"seed": 3})
        assert [s.observation for s in again] == [s.observation for s in steps]
        await pool.forget("t1")
        assert isinstance(await pool.step("t1", "5"), PluginFailure)  # closed and dropped
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "one of environment_args.env"),
        ({"env": "guess_game:GuessNumber", "url": "http://127.0.0.1:1"}, "one of environment_args.env"),
        ({"env": "guess_game:GuessNumber", "env_args": {"turns": 2, "colour": "red"}}, "colour"),
        ({"env": "guess_game:Nope"}, "Nope"),
        ({"env": "guess_game"}, "not module:Class"),
    ],
)
def test_bad_environment_args_are_refused(
    args: dict[str, Any], message: str, game_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(game_dir))
    with pytest.raises((ValueError, TypeError, AttributeError), match=message):
        OpenEnv(**args)


async def test_an_environment_that_cannot_play_is_an_error_before_the_run(game_dir: Path) -> None:
    """`libra config check` resets one episode: a server nobody runs, an observation without the
    field named, each a clear error."""
    with pytest.raises(PluginLoadError, match="Failed to connect to ws://127.0.0.1:1/ws"):
        await check_environment(ADAPTER, [str(game_dir)], {"seed": 1}, {"url": "http://127.0.0.1:1"})
    args = {"env": "guess_game:GuessNumber", "observation_field": "txt"}
    with pytest.raises(PluginLoadError, match="no field 'txt': it has \\['text'\\]"):
        await check_environment(ADAPTER, [str(game_dir)], {"seed": 1}, args)
