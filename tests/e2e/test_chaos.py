"""Chaos, small: kill -9 each service in turn in the middle of a job on a stack that restarts what
dies. Each comes back, rejoins the job from its durable state (the trainer's checkpoint, the
scheduler's ledger), and the job completes with every step's groups trained exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common import control
from services.common.bus import close_nats
from services.common.ownership import committed_key, trained_key
from services.common.runconfig import load_run_config
from tools.runner import run_job
from tools.stack import ROOT, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VICTIMS = ["rollout-engine-0", "tool-sandbox", "trainer", "planner", "scheduler"]
PAUSED = {"rollout-engine-1": 20.0, "trainer": 15.0}  # SIGSTOP for longer than the 10 s lease


def test_killed_services_come_back_and_the_job_completes(tiny_model: Any, tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["training"].update(steps=60, checkpoint_dir=str(tmp_path / "ckpt" / "{run_id}"))
    config = tmp_path / "chaos.yaml"
    config.write_text(yaml.safe_dump(data))
    cfg = load_run_config(config)
    run_id = f"chaos-{int(time.time())}"
    # a dead trainer's deliveries come back after the ack wait: short here, so the test is short
    stack = Stack(run_id, tmp_path / "logs", extra_env={"LIBRA_TRAINER_ACK_WAIT_S": "6"}, max_restarts=3)
    events: list[tuple[str, str, float]] = []

    def report_steps() -> int:
        return int(
            redis.Redis.from_url(stack.redis_url, decode_responses=True).hget(committed_key(run_id), "step")
            or 0
        )

    async def chaos() -> None:
        nc = await control.connect(stack.nats_url, "chaos")
        try:

            async def running(worker: str) -> bool:
                found = await control.discover(nc, 0.3)
                return any(st.worker_id == worker and st.run_id == run_id for st in found)

            while not await running("trainer"):
                await asyncio.sleep(0.2)
            for victim in VICTIMS:
                await asyncio.sleep(3.0)
                os.kill(stack.procs[victim].pid, signal.SIGKILL)
                killed = time.monotonic()
                events.append((victim, "killed", 0.0))
                await asyncio.sleep(1.5)  # until it has stopped answering as a job member
                while not await running(victim):
                    if time.monotonic() - killed > 90:
                        events.append((victim, "never came back", time.monotonic() - killed))
                        return
                    await asyncio.sleep(0.2)
                events.append((victim, "rejoined", time.monotonic() - killed))
            for victim, pause in PAUSED.items():  # hung, not dead: the lease expires, work moves on
                await asyncio.sleep(3.0)
                before = report_steps()
                os.kill(stack.procs[victim].pid, signal.SIGSTOP)
                await asyncio.sleep(pause)
                os.kill(stack.procs[victim].pid, signal.SIGCONT)
                resumed = time.monotonic()
                while report_steps() <= before + 1:  # two more steps after it is back
                    if time.monotonic() - resumed > 90:
                        events.append((f"{victim} paused", "job never moved on", time.monotonic() - resumed))
                        return
                    await asyncio.sleep(0.2)
                events.append((f"{victim} paused", "rejoined", time.monotonic() - resumed))
        finally:
            await close_nats(nc)

    stack.start_infra()
    try:
        stack.start_services(cfg.rollout.engines)
        t = threading.Thread(target=lambda: asyncio.run(chaos()), daemon=True)
        t.start()
        report = run_job(
            config, cfg, run_id=run_id, runs_dir=tmp_path, timeout_s=900, progress=False, stack=stack
        )
        t.join(120)
        trained = redis.Redis.from_url(stack.redis_url, decode_responses=True).scard(trained_key(run_id))
    finally:
        stack.stop()

    rejoined = {v: s for v, what, s in events if what == "rejoined"}
    groups = cfg.training.steps * cfg.training.groups_per_step
    trained_twice = report["trajectories_trained_twice"]  # from the fenced commit script
    print("\nfault (mid-job)                          recovered after")
    for victim in VICTIMS:
        back = f"{rejoined[victim]:.1f} s" if victim in rejoined else "never"
        print(f"  kill -9 {victim:<30} {back} (back in the job)")
    for victim, pause in PAUSED.items():
        back = f"{rejoined[victim + ' paused']:.1f} s" if victim + " paused" in rejoined else "never"
        print(f"  SIGSTOP {victim} {pause:.0f} s{'':<{20 - len(victim)}} {back} (2 more steps after SIGCONT)")
    print(
        f"job {report['status']} in {report['wall_s']:.0f} s; trained ids {trained} of "
        f"{groups * cfg.task.group_size}; trained twice {trained_twice}; "
        f"groups replaced {report['groups_replaced']}; restarts {report['restarts']}"
    )
    faults = set(VICTIMS) | {f"{v} paused" for v in PAUSED}
    assert set(rejoined) == faults, events  # every fault happened while the job ran, and it moved on
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == cfg.training.steps
    assert report["all_engines_on_final_version"], report["engines"]
    assert {v: report["restarts"].get(v) for v in VICTIMS} == dict.fromkeys(VICTIMS, 1), report["restarts"]
    assert set(report["rejoined"]) <= set(VICTIMS)
    # every trained group trained once: the trained-id set holds exactly steps x groups x samples
    # ids, and no committed step added an id that was already in it
    assert report["group_outcomes"]["trained"] == groups
    assert trained == groups * cfg.task.group_size
    assert trained_twice == 0
