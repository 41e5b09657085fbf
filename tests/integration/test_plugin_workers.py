"""User-code worker processes (rewards, environments) never outlive the scheduler that started
them: killed with -9 while a reward hangs, the scheduler takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.stack import ROOT

pytestmark = pytest.mark.integration

PARENT = """
import asyncio, sys
from services.scheduler.rewards import RewardPool

async def main():
    pool = RewardPool("hang:score", [sys.argv[1]], workers=2, timeout_s=3600)
    await pool.start()
    print(" ".join(str(w.proc.pid) for w in pool.workers), flush=True)
    await pool.score(response="", sample={}, trajectory={})  # hangs in the user's code

asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its (new) parent counts as gone
        return f.read().split()[2] != "Z"


def test_workers_die_with_a_scheduler_killed_while_a_reward_hangs(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text("import time\n\ndef score(**kw):\n    time.sleep(3600)\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(1.0)  # the call is in flight: one worker sleeps in the user's code
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()
