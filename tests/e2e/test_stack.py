"""The whole stack, five services as separate processes on real nats-server and Redis, running the
tiny job end to end, with garbage thrown at every subject first."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.runconfig import load_run_config
from tests.otlp_receiver import OtlpReceiver
from tools.runner import watch_job, write_report
from tools.stack import ROOT, Stack, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GARBAGE = [b"\xff\xfe garbage \x00\x01", b"", b"\x08" * 7]


async def throw_garbage(stack: Stack) -> None:
    bus = await Bus.connect(stack.nats_url, stack.run_id, "test", "garbage")
    try:
        plain = [
            subjects.TURN_RESULT,
            subjects.TOOL_CALL,
            subjects.TOOL_RETURN,
            subjects.ENGINE_LOAD,
            subjects.WORKER_HELLO,
            subjects.WEIGHTS_UPDATED,
            subjects.TRAIN_METRICS,
            subjects.SCHEDULER_STATS,
            subjects.PLAN,
            *[f"{subjects.TURN_REQUEST}.rollout-engine-{i}" for i in range(2)],
        ]
        for suffix in plain:
            for blob in GARBAGE:
                await bus.nc.publish(bus.subject(suffix), blob)
        await bus.ensure_stream("TRAJ", [subjects.TRAJ_COMPLETED])
        for i, blob in enumerate(GARBAGE):
            await bus.js.publish(
                bus.subject(subjects.TRAJ_COMPLETED), blob, headers={"Nats-Msg-Id": f"junk-{i}"}
            )
        await bus.nc.flush()
    finally:
        await bus.close()


def test_tiny_job_end_to_end(tiny_model, tmp_path: Path) -> None:
    config = ROOT / "configs" / "tiny.yaml"
    cfg = load_run_config(config)
    run_id = f"e2e{int(time.time())}"
    with OtlpReceiver() as otlp:
        stack = Stack(run_id, config, tmp_path / run_id / "logs", otlp.endpoint)
        stack.start_infra()
        try:
            stack.start_services(cfg.rollout.engines)
            time.sleep(3)  # let subscriptions come up, then throw garbage at all of them
            asyncio.run(throw_garbage(stack))
            report = asyncio.run(watch_job(stack, cfg, timeout_s=600, progress=False))
            assert stack.dead() == {}, "a service died"
        finally:
            stack.stop()
        write_report(report, tmp_path)
        time.sleep(1.5)  # the last batch of spans is exported on shutdown
        pids = list(report["services"].values())

    assert report["train_steps"] == cfg.training.steps
    assert report["final_weight_version"] == cfg.training.steps
    assert report["trajectories_completed"] >= cfg.trajectories_per_step * cfg.training.steps
    assert len(report["engines"]) == cfg.rollout.engines
    assert report["all_engines_on_final_version"], report["engines"]
    assert len(set(pids)) == len(pids) >= 6  # planner, sandbox, 2 engines, trainer, scheduler
    assert not [p for p in pids if pid_alive(p)], "orphan service processes"
    assert sum(report["tool_calls"].values()) >= 0
    assert (tmp_path / "latest" / "report.json").exists()

    # One trace per trajectory: scheduler, engine and trainer spans share it.
    traces = otlp.by_trace()
    roots = [s for s in otlp.spans if s.name == "trajectory"]
    assert len(roots) >= report["trajectories_completed"]
    t = traces[roots[0].trace_id]
    names = {s.name for s in t}
    assert {"trajectory", "turn.generate", "score"} <= names
    assert any(s.service == "libra-rollout-engine" for s in t), names
    step_links = {link for s in otlp.spans if s.name == "train.step" for link in s.links}
    assert step_links & {r.trace_id for r in roots}, "train steps link to the trajectories they trained on"
    assert os.path.exists(tmp_path / run_id / "logs" / "scheduler.log")
