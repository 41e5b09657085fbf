"""Where a host's CPU went, by process role: this machine's own /proc read as `libra bench live`
reads it around a job, and the arithmetic between two snapshots."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tools.host_cpu import Meter, role, snapshot, spent


def test_roles_are_named_by_the_processes_command_lines() -> None:
    assert role("VLLM::Worker") == "vllm worker"
    assert role("VLLM::EngineCore ") == "vllm engine core"
    assert role("/venv/bin/python -m services.rollout_engine") == "rollout-engine service"
    assert role("/venv/bin/python -m services.scheduler") == "other services"
    assert role("/venv/bin/nats-server -c x.conf") == role("redis-server *:6379") == "nats + redis"
    assert role("/venv/bin/python /venv/bin/libra bench live") == "libra command"
    assert role("bash") == "other"
    assert role("") == "kernel", "kernel threads have no command line"


def test_a_snapshot_sees_this_process_spend_cpu() -> None:
    before = snapshot()
    (me,) = [key for key in before if key[0] == os.getpid()]
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = snapshot()
    assert after[me][1] > before[me][1]
    used = spent(before, after, 1.0)
    assert used["other"]["cpu_s"] > 0 and used["other"]["cores"] == used["other"]["cpu_s"]


def test_spent_counts_new_processes_from_zero_and_a_renamed_one_by_its_last_role() -> None:
    before = {(1, 0): ("vllm worker", 10.0), (2, 5): ("vllm engine core", 5.0), (3, 0): ("other", 1.0)}
    after = {
        (1, 0): ("vllm worker", 14.0),
        (2, 9): ("vllm worker", 2.0),  # pid 2 reused by a process started later
        (4, 7): ("other services", 1.0),
        (5, 8): ("vllm engine core", 0.5),
    }
    before[(5, 8)] = ("other", 0.25)  # named by vLLM after it started
    before[(6, 1)] = ("vllm engine core", 1.0)
    after[(6, 1)] = ("kernel", 2.0)  # exiting: its command line is gone
    got = spent(before, after, 4.0)
    assert got == {
        "vllm worker": {"cpu_s": 6.0, "cores": 1.5},
        "other services": {"cpu_s": 1.0, "cores": 0.25},
        "vllm engine core": {"cpu_s": 1.25, "cores": 0.312},
    }
    assert list(got) == ["vllm worker", "vllm engine core", "other services"], "largest first"


def test_no_proc_directory_gives_nothing(tmp_path: Path) -> None:
    assert snapshot(tmp_path / "missing") == {}


def test_the_meter_counts_a_process_that_ends_inside_it() -> None:
    """A job's engines stop with the job: sampled while they ran, their seconds still count."""
    import subprocess
    import sys

    # named by its command line, as vLLM names its processes by their title
    spin = "import time  # VLLM::Worker\nt = time.process_time() + 0.5\nwhile time.process_time() < t: pass"
    with Meter(interval_s=0.1) as meter:
        subprocess.run([sys.executable, "-c", spin], check=True)
        time.sleep(0.3)
    assert meter.usage["vllm worker"]["cpu_s"] >= 0.3
