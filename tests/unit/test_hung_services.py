"""A service silent past its liveness timeout is hung, not gone: the job's runner kills it where a
supervisor will start another (the stack's own restarts, or `libra up`'s), waits for an
orchestrator's probe on a stack it only reaches, and fails the job only where nothing would
replace it or the replacement never answers. Real processes; the job runner's decision alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools import runner
from tools.stack import Stack


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_stack_kills_a_hung_service_only_where_it_restarts_it(tmp_path: Path) -> None:
    stack = Stack("t", tmp_path, max_restarts=2)
    stack.procs["scheduler"] = proc = _sleeper()
    try:
        assert stack.kill("scheduler") and proc.wait(10) == -9
        off = Stack("t", tmp_path, max_restarts=0)
        off.procs["scheduler"] = alive = _sleeper()
        assert not off.kill("scheduler") and alive.poll() is None, "no restarts: nothing would replace it"
        stack.procs["trainer"] = spent = _sleeper()
        stack.restarts["trainer"] = 2
        assert not stack.kill("trainer") and spent.poll() is None, "its restarts are used up"
        stack.gave_up["planner"] = 1
        assert not stack.kill("planner") and not stack.kill("nobody")
        assert not Stack.reached_at("nats://x:1", "redis://x:1", None, tmp_path).kill("scheduler")
    finally:
        for p in (proc, alive, spent):
            p.kill()
            p.wait()


class _Runner:
    """The job runner's state that `_replace_hung` reads and writes."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.replacing: dict[str, float] = {}
        self.replaced: dict[str, int] = {}

    def replace(self, wid: str, now: float) -> bool:
        return runner.JobDriver._replace_hung(self, wid, 40.0, now)  # type: ignore[arg-type]


def test_the_runner_replaces_a_hung_service_and_gives_its_replacement_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = Stack("t", tmp_path, max_restarts=2)
    stack.procs["scheduler"] = proc = _sleeper()
    job: Any = _Runner(stack)
    try:
        assert job.replace("scheduler", 100.0)
        assert proc.wait(10) == -9 and job.replaced == {"scheduler": 1}
        assert "scheduler silent for 40s (hung): killed" in capsys.readouterr().err
        assert job.replace("scheduler", 100.0 + runner.REPLACE_S - 1), "its replacement may still come"
        assert job.replaced == {"scheduler": 1}, "killed once"
        assert not job.replace("scheduler", 100.0 + runner.REPLACE_S + 1), "it never answered: the job fails"
    finally:
        proc.kill()
        proc.wait()
    remote: Any = _Runner(Stack.reached_at("nats://x:1", "redis://x:1", None, tmp_path))
    assert remote.replace("trainer", 0.0) and "waiting for its orchestrator" in capsys.readouterr().err
    unsupervised: Any = _Runner(Stack("t", tmp_path, max_restarts=0))
    unsupervised.stack.procs["trainer"] = other = _sleeper()
    try:
        assert not unsupervised.replace("trainer", 0.0) and other.poll() is None
    finally:
        other.kill()
        other.wait()
