"""An engine host (services/rollout_engine/host.py) serves many engine identities in one process:
each with its own credentials, refused when they are missing or another worker's; the stack runs
its engines in hosts of `engines_per_host`, and a dead host is each of its engines. The job with
hosts runs in tests/e2e/test_bench_live.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigFileError
from services.common.credentials import generate
from services.rollout_engine.host import EngineHostSettings, identities
from tools.stack import Stack


def test_a_host_serves_each_engine_under_its_own_credentials(tmp_path: Path) -> None:
    creds = generate(tmp_path / "secrets", workers=["rollout-engine-0", "rollout-engine-1", "trainer"])
    host = EngineHostSettings(workers="rollout-engine-0, rollout-engine-1", secrets_root=str(creds.root))
    commons = identities(host)
    assert [c.worker_id for c in commons] == ["rollout-engine-0", "rollout-engine-1"]
    assert [c.nats_user for c in commons] == ["rollout-engine-0", "rollout-engine-1"]
    assert [c.redis_user for c in commons] == ["rollout-engine-0", "rollout-engine-1"]
    assert commons[0].nats_password != commons[1].nats_password

    with pytest.raises(ConfigFileError) as missing:
        identities(EngineHostSettings(workers="rollout-engine-2", secrets_root=str(creds.root)))
    assert "no credentials of rollout-engine-2" in missing.value.message
    (creds.root / "rollout-engine-9").symlink_to(creds.root / "rollout-engine-0")
    with pytest.raises(ConfigFileError) as another:
        identities(EngineHostSettings(workers="rollout-engine-9", secrets_root=str(creds.root)))
    assert "credentials of worker 'rollout-engine-0'" in another.value.message


@pytest.mark.parametrize(
    ("workers", "why"),
    [
        ("trainer", "not rollout-engine worker ids"),
        ("rollout-engine-0,rollout-engine-0", "named twice"),
        ("rollout-engine-a.b", "not rollout-engine worker ids"),
        ("", "at least 1 character"),
    ],
)
def test_a_host_refuses_workers_that_are_not_engines(workers: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        EngineHostSettings(workers=workers)


def test_a_host_without_credentials_exits_with_a_clear_error(tmp_path: Path) -> None:
    env = {"PATH": "", "LIBRA_ENGINE_HOST_WORKERS": "rollout-engine-0", "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run(
        [sys.executable, "-m", "services.rollout_engine.host"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no credentials" in done.stderr
    env["LIBRA_ENGINE_HOST_SECRETS_ROOT"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "services.rollout_engine.host"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "has no credentials of rollout-engine-0" in done.stderr


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_stack_runs_its_engines_in_hosts_and_a_dead_host_is_each_of_its_engines(tmp_path: Path) -> None:
    stack = Stack("t", tmp_path, max_restarts=0, engines_per_host=3)
    stack.plan_processes(7)
    assert stack.processes() == [
        "planner",
        "tool-sandbox",
        "engine-host-0",
        "engine-host-1",
        "engine-host-2",
        "trainer",
        "scheduler",
    ]
    assert stack.engines() == {f"rollout-engine-{i}" for i in range(7)}
    assert (
        stack.process_of("rollout-engine-4") == "engine-host-1" and stack.process_of("trainer") == "trainer"
    )
    stack.procs["engine-host-1"] = host = _sleeper()
    stack.procs["trainer"] = trainer = _sleeper()
    try:
        host.kill()
        host.wait()
        assert stack.dead() == {f"rollout-engine-{i}": -9 for i in (3, 4, 5)}
    finally:
        trainer.kill()
        trainer.wait()
    one = Stack("t", tmp_path)
    one.plan_processes(2)
    assert one.processes() == [
        "planner",
        "tool-sandbox",
        "rollout-engine-0",
        "rollout-engine-1",
        "trainer",
        "scheduler",
    ]
