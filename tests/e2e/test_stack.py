"""The whole stack, five services as separate processes on real nats-server and Redis, started idle
as `libra up` starts it; jobs are submitted to it as `libra run` submits them, with a real (tiny)
model. Garbage, forged messages, a forged plan and a killed service are thrown at it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common import control, subjects
from services.common.bus import Bus, Envelope, close_nats
from services.common.contracts import ev
from services.common.ownership import committed_key
from services.common.runconfig import load_run_config
from services.common.streams import STREAMS
from tests import in_process
from tests.otlp_receiver import OtlpReceiver
from tools.runner import run_job
from tools.stack import ROOT, Stack, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = ROOT / "configs" / "tiny.yaml"
TOOLS_WORKLOAD = Path(__file__).parent / "workloads" / "tiny_tools.yaml"
GARBAGE = [b"\xff\xfe garbage \x00\x01", b"", b"\x08" * 7]


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(tiny_model: Any, otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An idle stack, as `libra up configs/tiny.yaml` starts it."""
    logs = tmp_path_factory.mktemp("stack") / "logs"
    # workload stats every 0.5 s (default 5 s) and engine loads every 0.2 s (default 1 s): a tiny
    # job lasts only seconds, and its timeline must still have the engines' samples
    env = {"LIBRA_SCHEDULER_STATS_INTERVAL_S": "0.5", "LIBRA_ROLLOUT_ENGINE_LOAD_REPORT_INTERVAL_S": "0.2"}
    s = Stack(f"e2e-{int(time.time())}", logs, otlp.endpoint, env)
    s.start_infra(load_run_config(TINY).rollout.engines)
    try:
        s.start_services()
        yield s
    finally:
        s.stop()


RUN = f"{int(time.time())}"  # run ids unique to this session: nothing resumes an earlier session's job


def _config(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    """configs/tiny.yaml with `sections` merged in and checkpoints under `tmp_path`."""
    data = yaml.safe_load(TINY.read_text())
    sections.setdefault("training", {})["checkpoint_dir"] = str(tmp_path / "ckpt" / "{run_id}")
    for key, values in sections.items():
        data.setdefault(key, {}).update(values)
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(stack: Stack, config: Path, run_id: str, runs: Path) -> dict[str, Any]:
    cfg = load_run_config(config)
    return run_job(config, cfg, run_id=run_id, runs_dir=runs, timeout_s=600, progress=False, stack=stack)


def _project_with_stack(
    stack: Stack, tmp_path: Path
) -> tuple[Path, Callable[..., subprocess.CompletedProcess[str]]]:
    """A project directory where `libra up` started `stack` (its `.libra/stack.json`), and the
    `libra` command run in a sub-directory of it, `experiments/today`."""
    project = tmp_path / "project"
    (project / ".libra").mkdir(parents=True)
    (project / ".libra" / "stack.json").write_text(json.dumps(stack.state()))  # as `libra up` writes it
    sub = project / "experiments" / "today"
    sub.mkdir(parents=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

    def libra(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "tools.cli", *args]
        return subprocess.run(argv, cwd=sub, env=env, capture_output=True, text=True, timeout=timeout)

    return project, libra


def _meanwhile(
    stack: Stack, run_id: str, action: Callable[[dict[str, Bus]], Any], on: str = ""
) -> threading.Thread:
    """Runs `action` once the job runs on the stack (on worker `on` if given), in a thread beside
    `run_job`, with the job's bus as each of the stack's identities (the publishers it authorises)."""

    async def go() -> None:
        nc = await control.connect(stack.nats_url, "test-watch", stack.nats_auth("cli"))
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                found = await control.discover(nc, 0.3)
                if any(st.run_id == run_id and st.worker_id.startswith(on) for st in found):
                    break
        finally:
            await close_nats(nc)
        buses: dict[str, Bus] = {}  # one worker of each kind (the stack has an identity per worker)
        assert stack.credentials is not None
        for i in stack.credentials.identities():
            if i.kind not in buses:
                buses[i.kind] = await Bus.connect(
                    stack.nats_url, run_id, i.kind, i.name, stack.nats_auth(i.name)
                )
        try:
            await action(buses)
            for bus in buses.values():
                await bus.nc.flush()
        finally:
            for bus in buses.values():
                await bus.close()
                await close_nats(bus.nc)

    t = threading.Thread(target=lambda: asyncio.run(go()), daemon=True)
    t.start()
    return t


async def _garbage_and_forgeries(buses: dict[str, Bus]) -> None:
    """Garbage on every subject from the identity allowed to publish there (a buggy service, not an
    intruder: strangers are refused by NATS itself, tests/integration/test_auth.py)."""
    owners = {
        "rollout-engine": [subjects.TURN_RESULT, subjects.ENGINE_LOAD, subjects.WORKER_HELLO],
        "scheduler": [subjects.TOOL_CALL, *[f"{subjects.TURN_REQUEST}.rollout-engine-{i}" for i in range(2)]],
        "tool-sandbox": [subjects.TOOL_RETURN],
        "trainer": [subjects.WEIGHTS_UPDATED, subjects.TRAIN_METRICS],
        "cli": [subjects.SCHEDULER_STATS, subjects.ROLE_REQUEST],
        "planner": [subjects.PLAN],  # random bytes become the PLAN stream's only message
    }
    for identity, suffixes in owners.items():
        bus = buses[identity]
        for suffix in suffixes:
            for blob in GARBAGE:
                await bus.nc.publish(bus.outgoing(suffix), blob)
    scheduler = buses["scheduler"]
    await scheduler.bind_stream("TRAJ")
    for i, blob in enumerate(GARBAGE):
        await scheduler.js.publish(
            scheduler.subject(subjects.TRAJ_COMPLETED), blob, headers={"Nats-Msg-Id": f"junk-{i}"}
        )
    for nc_subject in (control.JOB_START, control.JOB_STOP, control.STATUS):
        await buses["cli"].nc.publish(nc_subject, GARBAGE[0])
    # a forged end of training, at a step and version the trainer never reached
    forged = ev.TrainMetrics(step=9, weight_version=10**12, done=True)
    await buses["trainer"].publish(subjects.TRAIN_METRICS, forged)


def test_two_jobs_one_after_the_other_on_one_stack(stack: Stack, otlp: OtlpReceiver, tmp_path: Path) -> None:
    cfg = load_run_config(TINY)
    pids = {name: p.pid for name, p in stack.procs.items()}
    job_a, job_b = f"job-a-{RUN}", f"job-b-{RUN}"
    intruder = _meanwhile(stack, job_a, _garbage_and_forgeries)
    first = _run(stack, _config(tmp_path), job_a, tmp_path)
    intruder.join(60)
    workload: list[ev.WorkloadStats] = []

    async def watch_workload(buses: dict[str, Bus]) -> None:
        async def on_stats(m: ev.WorkloadStats, _: Any) -> None:
            if m.new_tokens_per_turn.count:
                workload.append(m)

        await buses["cli"].subscribe(subjects.WORKLOAD_STATS, ev.WorkloadStats, on_stats)
        deadline = time.monotonic() + 90
        while not workload and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    watcher = _meanwhile(stack, job_b, watch_workload)
    # the second job speculates on the same engines; sampled near-greedily, the random model
    # repeats itself, so its drafts (from its own context and its siblings') are accepted
    spec = {"speculative": {"method": "suffix", "num_tokens": 4, "policy": "fixed"}}
    config_b = _config(tmp_path, rollout=spec, task={"temperature": 0.05})
    # ...and is started as a user starts it: `libra run` in a sub-directory of the project where
    # `libra up` started the stack; it finds the stack above it and says which it uses
    project, libra = _project_with_stack(stack, tmp_path)
    out = libra("run", str(config_b), "--run-id", job_b)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"on the stack {stack.name} that `libra up` started ({project / '.libra' / 'stack.json'})"
        in out.stderr
    )
    assert "--embedded" in out.stderr  # how to pick a stack of its own instead
    sub = project / "experiments" / "today"
    second = json.loads((sub / "runs" / job_b / "report.json").read_text())
    second["report_path"] = str(sub / "runs" / job_b / "report.json")  # what run_job would return
    assert not (sub / ".libra" / "data").exists()  # no embedded stack's state: none was started
    # (these three in this process: the same `libra` found the stack above `sub` as a process does)
    status = in_process.libra("status", cwd=sub, clean=False)
    assert status.returncode == 0 and stack.name in status.stdout and str(project) in status.stdout
    too_big = in_process.libra("config", "check", "tiny", "--rollout.engines", "3", cwd=sub, clean=False)
    assert too_big.returncode == 2 and "rollout.engines: the job needs 3" in too_big.stderr, too_big.stderr
    assert f"the stack {stack.name}" in too_big.stderr and "runs 2" in too_big.stderr
    refused = in_process.libra("up", "tiny", cwd=sub, clean=False)  # a second stack under the first one's
    assert refused.returncode == 1 and str(project / ".libra" / "stack.json") in refused.stderr
    watcher.join(60)

    for report in (first, second):
        assert report["status"] == "completed", report["reason"]
        # from the trainer's commit record and the engines themselves, not from the forged `done`
        assert report["train_steps"] == cfg.training.steps
        assert report["final_weight_version"] == cfg.training.steps
        assert report["trajectories_completed"] >= cfg.trajectories_per_step * cfg.training.steps
        assert len(report["engines"]) == cfg.rollout.engines
        assert report["all_engines_on_final_version"], report["engines"]
        assert report["services_not_stopped"] == []
        assert Path(report["report_path"]).exists()
        # a completed job's streams are gone once its report is built (job.keep_streams: false)
        assert report["streams_deleted"] == [subjects.stream_name(report["run_id"], s.what) for s in STREAMS]
        # what each step trained on, as the trainer counted it; a step without it is said so
        informative = report["groups_informative_per_step"]
        assert len(informative) == cfg.training.steps
        assert all(0 <= g <= cfg.training.groups_per_step for g in informative)
        idle = informative.count(0)
        assert report["steps_without_update"] == idle and bool(report["warnings"]) == bool(idle)
        # every launched group accounted for by the trainer's outcomes; what was not trained, replaced
        outcomes = report["group_outcomes"]
        assert outcomes["trained"] == cfg.training.steps * cfg.training.groups_per_step, outcomes
        assert report["groups_replaced"] == sum(n for o, n in outcomes.items() if o != "trained")
        # the plan's buckets, with the engines in each; no migrations (one bucket)
        engines = sorted(f"rollout-engine-{i}" for i in range(cfg.rollout.engines))
        assert [(b["name"], b["tensor_parallel"], b["engines"]) for b in report["buckets"]] == [
            (cfg.rollout.buckets[0].name, 1, engines)
        ]
        assert report["migrations"] == 0
        # the planner's fenced plan history: every plan under its lease's epoch
        assert report["plans"] and all(p["epoch"] >= 1 for p in report["plans"]), report["plans"]
        assert report["plans"][0]["reason"] == "static"
        # every trajectory handed to the trainer is trained, dropped with its group, or still open
        acc = report["trajectories_accounting"]
        assert report["trajectories_lost"] == 0 and acc["lost_ids"] == [], acc
        assert acc["trained"] == cfg.trajectories_per_step * cfg.training.steps, acc
        assert acc["handed_to_trainer"] == acc["trained"] + acc["dropped"] + acc["open_at_end"]
    # speculative decoding, as the engines counted it, over the job and per step
    assert first["speculation"] is None
    sp = second["speculation"]
    assert sp["method"] == "suffix" and 0 < sp["accepted_tokens"] <= sp["drafted_tokens"], sp
    assert len(sp["acceptance_rate_per_step"]) == cfg.training.steps
    # the scheduler's workload stats for the planner: turn lengths within the token budget
    assert workload, "no workload.stats with turns in it"
    w = workload[-1]
    assert 0 < w.new_tokens_per_turn.max <= cfg.task.max_new_tokens
    assert w.context_tokens_per_turn.p50 > 0 and w.trained_version >= 0
    assert first["report_path"] != second["report_path"]
    assert (sub / "runs" / "latest" / "report.json").resolve() == Path(second["report_path"]).resolve()
    # one set of services served both jobs
    assert sorted(first["services"].values()) == sorted(second["services"].values()) == sorted(pids.values())
    assert stack.dead() == {}

    # One trace per trajectory: scheduler, engine and trainer spans share it.
    time.sleep(2.0)  # spans leave each service in 0.5 s batches
    roots = [s for s in otlp.spans if s.name == "trajectory" and s.attributes.get("libra.run_id") == job_a]
    assert len(roots) >= first["trajectories_completed"]
    names = {s.name for s in otlp.by_trace()[roots[0].trace_id]}
    assert {"trajectory", "turn.generate", "score"} <= names

    def engine_in_a_trajectory_trace() -> bool:
        traces = otlp.by_trace()
        return any(any(s.service == "libra-rollout-engine" for s in traces[r.trace_id]) for r in roots)

    deadline = time.monotonic() + 20  # a busy engine's last span batch can come after the sleep
    while not engine_in_a_trajectory_trace() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engine_in_a_trajectory_trace()
    step_links = {link for s in otlp.spans if s.name == "train.step" for link in s.links}
    assert step_links & {r.trace_id for r in roots}, "train steps link to the trajectories they trained on"
    assert os.path.exists(stack.log_dir / "scheduler.log")


def _metrics(stack: Stack, worker_id: str) -> tuple[str, dict[str, float]]:
    """GET the service's /metrics as a scraper would: the text, and each unlabelled sample's value."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{stack.metrics_ports[worker_id]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    values = {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
    }
    return text, values


def test_every_service_serves_prometheus_metrics(stack: Stack) -> None:
    """After the jobs above: what each service counted, in Prometheus text on its own port."""
    text, scheduler = _metrics(stack, "scheduler")
    assert (
        scheduler["libra_scheduler_trajectories_total"] > 0 and scheduler["libra_scheduler_turns_total"] > 0
    )
    for name in (
        "libra_scheduler_tool_calls_total",
        "libra_scheduler_in_flight",
        "libra_scheduler_reward_bucket",
    ):
        assert name in text
    assert (
        'libra_scheduler_queue_depth{bucket="short"}' in text
        and "libra_scheduler_trajectory_seconds_count" in text
    )
    for i in range(2):
        text, engine = _metrics(stack, f"rollout-engine-{i}")
        assert (
            engine["libra_engine_generated_tokens_total"] > 0 and engine["libra_engine_weight_version"] >= 1
        )
        for name in ("libra_engine_running", "libra_engine_waiting", "libra_engine_tokens_per_second"):
            assert name in engine
    _, trainer = _metrics(stack, "trainer")
    assert trainer["libra_trainer_steps_total"] >= 2 and trainer["libra_trainer_step_seconds_count"] >= 2
    assert trainer["libra_trainer_weight_version"] >= 2 and "libra_trainer_reward_mean" in trainer
    text, _ = _metrics(stack, "tool-sandbox")
    assert 'libra_sandbox_tool_calls_total{status="ok",tool="python"}' in text
    assert 'libra_sandbox_tool_seconds_count{tool="calculator"}' in text
    _, planner = _metrics(stack, "planner")
    assert planner["libra_planner_plans_total"] >= 1 and planner["libra_planner_plan_version"] >= 1


def test_libra_trace_prints_a_trajectory_from_queue_to_training_step(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.trace_view import main as trace_main
    from tools.trace_view import read_spans

    run_id = f"traced-{RUN}"
    report = _run(stack, _config(tmp_path), run_id, tmp_path)
    assert report["status"] == "completed", report["reason"]
    rows = read_spans(tmp_path / run_id / "traces")
    assert {r.service for r in rows} >= {"scheduler", "rollout-engine", "trainer"}
    trained = {r.trace_id for r in rows if r.name == "train.step" and r.parent_id}
    traj = next(r for r in rows if r.name == "trajectory" and r.trace_id in trained)
    trajectory_id = str(traj.attributes["libra.trajectory_id"])
    capsys.readouterr()
    assert trace_main([trajectory_id, "--run", run_id, "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trajectory {trajectory_id}")
    for span in ("trajectory", "turn.generate", "engine.generate", "engine.queue", "train.step"):
        assert f" {span} " in out, (span, out)
    assert "train_step=" in out
    assert trace_main(["--run", run_id, "--runs-dir", str(tmp_path)]) == 0
    assert "trajectories traced; the slowest:" in capsys.readouterr().out
    assert trace_main(["no-such-trajectory", "--run", run_id, "--runs-dir", str(tmp_path)]) == 1
    # ...and the run's timeline, with its plots
    out_dir = tmp_path / run_id
    timeline = json.loads((out_dir / "timeline.json").read_text())
    assert timeline["samples"] and timeline["engines"] and [s["step"] for s in timeline["steps"]] == [1, 2]
    assert {Path(p).name for p in report["plots"]} >= {"throughput.png", "engines.png"}


def test_trajectories_move_between_buckets_after_tool_returns_and_keep_their_versions(
    stack: Stack, tmp_path: Path
) -> None:
    """A synthetic workload with tool calls over two buckets: C-MLFQ moves trajectories to the long
    bucket after their first tool return (their output passed the short bucket's budget), every
    turn has exactly its scripted length, and the trainer gets one segment per weight version."""
    config = _config(
        tmp_path,
        task={"dataset": "synthetic", "workload": str(TOOLS_WORKLOAD), "max_context_tokens": 512},
        rollout={"buckets": [{"name": "short", "max_output_tokens": 4}, {"name": "long"}]},
    )
    cfg = load_run_config(config)
    run_id = f"job-buckets-{RUN}"
    completed: list[ev.CompletedTrajectory] = []

    async def collect(buses: dict[str, Bus]) -> None:
        async def on_traj(m: ev.CompletedTrajectory, _: Any) -> None:
            completed.append(m)

        await buses["cli"].subscribe(subjects.TRAJ_COMPLETED, ev.CompletedTrajectory, on_traj)
        deadline = time.monotonic() + 240
        while len(completed) < cfg.trajectories_per_step * cfg.training.steps and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    watcher = _meanwhile(stack, run_id, collect)
    report = _run(stack, config, run_id, tmp_path)
    watcher.join(60)
    assert report["status"] == "completed", report["reason"]
    assert report["trajectories_lost"] == 0
    buckets = {b["name"]: b["engines"] for b in report["buckets"]}
    assert sorted(buckets) == ["long", "short"] and all(len(e) == 1 for e in buckets.values()), buckets
    assert report["migrations"] >= cfg.trajectories_per_step, "trajectories moved to the long bucket"
    assert report["tool_calls"].get("ok", 0) > 0, report["tool_calls"]
    # the run's samples: every group of its first and last steps, as text, tool calls included
    samples = [json.loads(line) for line in Path(report["samples"]["path"]).read_text().splitlines()]
    assert report["samples"]["trajectories"] == len(samples) >= 2 * cfg.trajectories_per_step
    assert {s["step"] for s in samples} >= {1, cfg.training.steps} and all(
        s["outcome"] == "trained" for s in samples
    )
    calls = [e for s in samples for e in s["events"] if e["role"] == "tool"]
    assert calls and all(e["tool"] and isinstance(e["args"], dict) and e["status"] for e in calls), calls[:3]
    assert all(s["advantage"] is not None and len(s["events"]) == 5 for s in samples)  # 3 turns, 2 calls
    # and nothing secret: no credential of any of the stack's identities appears in them
    assert stack.credentials is not None
    text = Path(report["samples"]["path"]).read_text()
    secrets = [
        f.read_text().strip()
        for f in stack.credentials.root.rglob("libra_*")
        if f.is_file() and not f.name.endswith(("_user", "_worker"))
    ]
    assert secrets and not [x for x in secrets if len(x) >= 16 and x in text]
    assert completed, "no completed trajectory seen on the bus"
    for traj in completed:
        assert traj.num_turns == 3 and traj.finish == "answer", (traj.num_turns, traj.finish)
        generated = [s for s in traj.segments if s.generated]
        versions = [s.policy_version for s in generated]
        assert versions == sorted(versions) and min(versions) >= 0
        assert (traj.min_policy_version, traj.max_policy_version) == (min(versions), max(versions))
        assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in generated)
        # turns split at a weight swap only: consecutive generated segments differ in version
        prompts_and_tools = [s for s in traj.segments if not s.generated]
        assert len(prompts_and_tools) == 3, "the prompt and two tool returns"
        # where its time went: two tool calls and three turns in engines, within its latency
        b = traj.breakdown
        assert b.tool_s > 0 and b.generate_s > 0, b
        parts = b.scheduler_queue_s + b.engine_queue_s + b.generate_s + b.tool_s
        assert parts <= traj.latency_s + 1e-3, (parts, traj.latency_s)


def test_an_engine_drained_mid_run_hands_its_turns_back_and_the_job_loses_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    """The operator drains one of two engines through the planner while trajectories are in
    flight: the engine hands its turns back, the scheduler re-sends them to the other, and the job
    completes with nothing lost or trained twice; the plan history shows the change."""
    config = _config(tmp_path, training={"steps": 4})
    cfg = load_run_config(config)
    run_id = f"job-drain-{RUN}"
    acks: list[ev.RoleChange] = []

    async def drain(buses: dict[str, Bus]) -> None:
        await _until_completed(buses["cli"])  # mid-run
        req = ev.RoleChange(worker_id="rollout-engine-0", to_role="draining")
        acks.append(await buses["cli"].request(subjects.ROLE_REQUEST, req, ev.RoleChange, 10))

    watcher = _meanwhile(stack, run_id, drain)
    report = _run(stack, config, run_id, tmp_path)
    watcher.join(60)
    assert acks and (acks[0].from_role, acks[0].to_role) == ("rollout", "draining"), acks
    assert report["status"] == "completed", report["reason"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    assert report["train_steps"] == cfg.training.steps
    reasons = [p["reason"] for p in report["plans"]]
    assert "role_change:rollout-engine-0:rollout->draining" in reasons, reasons
    served = {b["name"]: b["engines"] for b in report["buckets"]}
    assert served == {cfg.rollout.buckets[0].name: ["rollout-engine-1"]}, served
    serving = {e["id"]: e["serving"] for e in report["engines"]}
    assert serving == {"rollout-engine-0": False, "rollout-engine-1": True}, report["engines"]
    assert report["all_engines_on_final_version"], "the serving engine has the final weights"


def test_the_trainer_serves_lent_turns_with_its_own_model_and_trains_between(
    stack: Stack, tmp_path: Path
) -> None:
    """planner.lending.trainer_serves on the stack `libra up` starts (an identity per worker): the
    trainer process is the lent engine. Parked at start, lent whenever it waits for its batch, it
    answers turns with the learner's own model under its own worker id, and is parked before each
    step; the job completes with nothing lost or trained twice, on one rollout engine besides."""
    config = _config(
        tmp_path,
        rollout={"engines": 1},
        training={"steps": 4},
        planner={"lending": {"engines": 1, "trainer_serves": True, "policy": "always"}},
    )
    cfg = load_run_config(config)
    report = _run(stack, config, f"job-lend-trainer-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    assert report["train_steps"] == cfg.training.steps
    lending = report["lending"]
    assert lending["lends"] >= 1 and lending["reclaims"] >= 1, lending
    assert lending["turns_served_by_trainer"] >= 1, lending
    moves = [(c["worker"], c["from"], c["to"]) for c in report["role_changes"] if "from" in c]
    assert ("trainer-engine", "parked", "lent") in moves and ("trainer-engine", "lent", "parked") in moves
    assert {w for w, _, _ in moves} == {"trainer-engine"}, moves  # no engine process was parked


def test_an_engine_moved_into_training_computes_gradients_and_comes_back_to_rollout(
    stack: Stack, otlp: OtlpReceiver, tmp_path: Path
) -> None:
    """The hybrid pool live: mid-run an engine is moved into training. It hands its turns back,
    loads the model for training, joins the trainer's data-parallel group at a step boundary and
    computes part of the next steps' gradients (their metrics say two replicas); moved back, it
    leaves at the next boundary and serves again, on the final weights. Nothing is lost or trained
    twice, and the report lists both role changes with their seconds and steps."""
    config = _config(tmp_path, training={"steps": 6})
    run_id = f"job-hybrid-{RUN}"
    acks: list[ev.RoleChange] = []
    states: list[ev.HybridState] = []
    replicas: list[int] = []

    async def move(buses: dict[str, Bus]) -> None:
        cli = watch = buses["cli"]  # the operator may watch every run subject; a service only its own

        async def on_state(m: ev.HybridState, _: Envelope) -> None:
            states.append(m)

        async def on_metrics(m: ev.TrainMetrics, _: Envelope) -> None:
            replicas.append(m.data_parallel)

        await watch.subscribe(subjects.HYBRID_STATE, ev.HybridState, on_state)
        await watch.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, on_metrics)
        await _until_completed(cli)
        req = ev.RoleChange(worker_id="rollout-engine-0", to_role="hybrid")
        acks.append(await cli.request(subjects.ROLE_REQUEST, req, ev.RoleChange, 10))
        deadline = time.monotonic() + 180
        while 2 not in replicas and time.monotonic() < deadline:  # a step with the replica
            await asyncio.sleep(0.1)
        back = ev.RoleChange(worker_id="rollout-engine-0", to_role="rollout")
        acks.append(await cli.request(subjects.ROLE_REQUEST, back, ev.RoleChange, 10))
        while not any(s.state == "released" for s in states) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    watcher = _meanwhile(stack, run_id, move)
    report = _run(stack, config, run_id, tmp_path)
    watcher.join(240)
    assert [(a.from_role, a.to_role) for a in acks] == [("rollout", "hybrid"), ("hybrid", "rollout")], acks
    assert report["status"] == "completed", report["reason"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    assert 2 in replicas, f"no step had the hybrid replica: {replicas}"
    mine = [s.state for s in states if s.worker_id == "rollout-engine-0" and s.state != "ready"]
    assert mine[:3] == ["drained", "fetched", "joined"] and mine[-1] == "released", mine
    changes = report["role_changes"]
    assert [(c["worker"], c["from"], c["to"]) for c in changes] == [
        ("rollout-engine-0", "rollout", "hybrid"),
        ("rollout-engine-0", "hybrid", "rollout"),
    ], changes
    into, out = changes
    assert into["seconds"] is not None and into["seconds"] > 0, into
    assert {"drained", "fetched", "joined"} <= set(into["steps"]), into
    assert out["seconds"] is not None and "released" in out["steps"], out
    serving = {e["id"]: e["serving"] for e in report["engines"]}
    assert serving == {"rollout-engine-0": True, "rollout-engine-1": True}, report["engines"]
    assert report["all_engines_on_final_version"], "the engine back from training has the final weights"
    # and in the trace: both changes, the trainer's join, the worker's stint with its steps, a step of two
    time.sleep(2.0)  # spans leave each service in 0.5 s batches
    moves = [
        (s.attributes["libra.from_role"], s.attributes["libra.to_role"])
        for s in otlp.spans
        if s.name == "plan.role_change" and s.attributes.get("libra.worker_id") == "rollout-engine-0"
    ]
    assert ("rollout", "hybrid") in moves and ("hybrid", "rollout") in moves, moves
    assert any(s.name == "hybrid.join" and s.service == "libra-trainer" for s in otlp.spans)
    stints = [
        s
        for s in otlp.spans
        if s.name == "hybrid.stint" and s.attributes["libra.worker_id"] == "rollout-engine-0"
    ]
    assert stints and stints[-1].events[:3] == ["drained", "fetched", "joined"], [s.events for s in stints]
    assert stints[-1].events[-1] == "released"
    assert any(s.name == "train.step" and s.attributes.get("libra.data_parallel") == 2 for s in otlp.spans)


async def _until_completed(cli: Bus, timeout_s: float = 60) -> None:
    """Until the scheduler says some trajectory completed (the job is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            stats = await cli.request(subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, 2)
            if stats.trajectories_completed:
                return
        await asyncio.sleep(0.05)


REWARD_PLUGIN = """
import time

def constant(response, sample, trajectory):
    assert isinstance(response, str) and sample["answer"] and isinstance(trajectory["turns"], list)
    return {"score": 0.25}

def moody(response, sample, trajectory):
    if sample["mode"] == "raise":
        raise RuntimeError("this reward has a bug")
    if sample["mode"] == "hang":
        time.sleep(3600)
    return 1.0
"""


def _own_task(tmp_path: Path, modes: list[str]) -> tuple[Path, Path]:
    """A JSONL dataset (text and chat prompts) and a reward module, both outside services/."""
    data = tmp_path / "data" / "mine.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "question": f"Say the number {i}." if i % 2 else [{"role": "user", "content": f"Count to {i}."}],
            "answer": str(i),
            "mode": mode,
        }
        for i, mode in enumerate(modes)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "my_rewards.py").write_text(REWARD_PLUGIN)
    return data, plugins


def test_a_dataset_and_reward_of_your_own_train_with_exactly_that_reward(
    stack: Stack, tmp_path: Path
) -> None:
    data, plugins = _own_task(tmp_path, ["ok"] * 6)
    task = {
        "dataset": {"path": str(data), "prompt_key": "question", "answer_key": "answer"},
        "reward": "my_rewards:constant",
        "plugin_paths": [str(plugins)],
        "tool_plugins": [str(ROOT / "examples" / "custom" / "unit_tool.py")],  # loaded by the sandbox
        "tools": ["convert", "calculator"],
    }
    job = {"loggers": ["tensorboard", "mlflow"]}
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False}, job=job)
    report = _run(stack, config, f"own-task-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    assert report["reward_mean_per_step"] == [0.25, 0.25]
    # the experiment loggers got the same steps (TensorBoard read back with its own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / f"own-task-{RUN}" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.25)]
    assert list((tmp_path / "mlruns").glob("*/*/metrics/train.reward_mean"))
    assert report["trajectories_failed"] == 0 and report["trajectories_lost"] == 0
    assert report["reward"] == f"{data}: task.reward my_rewards:constant"


def test_rewards_that_raise_or_hang_fail_only_their_trajectories(stack: Stack, tmp_path: Path) -> None:
    data, plugins = _own_task(tmp_path, ["ok", "raise", "ok", "hang", "ok", "ok"])
    task = {
        "dataset": {"path": str(data), "prompt_key": "question"},
        "reward": "my_rewards:moody",
        "plugin_paths": [str(plugins)],
        "reward_timeout_s": 2.0,
    }
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False})
    report = _run(stack, config, f"moody-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    failed = report["trajectories_failed_by_code"]
    assert failed.get("reward_error", 0) >= 1 and failed.get("reward_timeout", 0) >= 1, failed
    assert report["reward_mean_per_step"] == [1.0, 1.0]  # failed trajectories are never trained on
    assert report["trajectories_lost"] == 0


def test_a_reward_that_fails_on_every_call_ends_the_job_failed_with_its_exception(
    stack: Stack, tmp_path: Path
) -> None:
    """It passes `config check` (it works on the dataset's first row), then raises on every other
    prompt: the job must not replace failed groups forever, but end failed, saying why and where."""
    data, plugins = _own_task(tmp_path, ["ok"] + ["raise"] * 40)
    task = {"dataset": {"path": str(data), "prompt_key": "question"}, "reward": "my_rewards:moody"}
    config = _config(tmp_path, task={**task, "plugin_paths": [str(plugins)], "num_prompts": 41})
    report = _run(stack, config, f"broken-reward-{RUN}", tmp_path)
    assert report["status"] == "failed", report["reason"]
    assert "(user_code)" in report["reason"] and "of the last 20 trajectories failed" in report["reason"]
    assert "RuntimeError: this reward has a bug (at my_rewards.py:" in report["reason"]
    assert report["train_steps"] == 0 and report["trajectories_lost"] == 0


def test_held_out_evaluation_scores_each_policy_and_trains_on_none_of_it(
    stack: Stack, tmp_path: Path
) -> None:
    """eval.every: the initial, intermediate and final policies scored on a held-out file by the
    task's reward, two samples a prompt with their pass@1 and pass@2 (a reward that raises fails
    its evaluation trajectory, counted by code), while
    training sees none of those trajectories; the job ends once the final policy is scored."""
    data, plugins = _own_task(tmp_path, ["ok"] * 6)
    held_out = tmp_path / "data" / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"question": f"Name {i}.", "answer": str(i), "mode": m}) + "\n"
                for i, m in enumerate(["ok", "raise", "ok", "ok", "ok"]))
    )  # fmt: skip
    task = {
        "dataset": {"path": str(data), "prompt_key": "question"},
        "reward": "my_rewards:moody",
        "plugin_paths": [str(plugins)],
    }
    evaluation = {
        "every": 1,
        "prompts": 4,
        "samples": 2,
        "dataset": {"path": str(held_out), "prompt_key": "question"},
    }
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False}, eval=evaluation)
    report = _run(stack, config, f"eval-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    rounds = report["eval"]
    assert [r["version"] for r in rounds] == [0, 1, 2]
    for r in rounds:  # the first 4 rows, 2 samples each: one row raises
        assert (r["prompts"], r["completed"], r["failed"], r["reward_mean"]) == (
            4,
            6,
            {"reward_error": 2},
            1.0,
        ), r
        assert r["pass_at_k"] == {"1": 1.0, "2": 1.0} and r["solved"] == 6  # of the prompts that scored
        assert r["policy_versions"] and min(r["policy_versions"]) >= r["version"]  # never an older policy
    assert report["trajectories_failed_by_code"] == {}  # the evaluation's failure is its round's
    accounting = report["trajectories_accounting"]
    assert accounting["handed_to_trainer"] == report["trajectories_completed"]
    assert report["reward_mean_per_step"] == [1.0, 1.0]


ENV_PLUGIN = """
class Countdown:
    \"\"\"Three turns whatever the model writes: an observation, a calculator call, then the end.\"\"\"

    def reset(self, sample):
        self.sample, self.turns, self.tools = sample, 0, []
        return f"Count down from {sample['answer']}."

    def step(self, response):
        assert isinstance(response, str)
        if self.sample["mode"] == "raise":
            raise RuntimeError("this environment has a bug")
        self.turns += 1
        if self.turns == 1:
            return {"observation": "Go on."}
        if self.turns == 2:
            return {"tool_call": {"name": "calculator", "arguments": {"expression": "2+3"}}}
        return {"done": True, "reward": 0.5 if self.tools == [("calculator", "ok", "Result: 5")] else -1.0}

    def tool_result(self, tool, status, output):
        self.tools.append((tool, status, output))
"""


def test_an_environment_of_your_own_drives_every_turn(stack: Stack, tmp_path: Path) -> None:
    data, plugins = _own_task(tmp_path, ["ok", "ok", "raise", "ok", "ok", "ok"])
    (plugins / "my_env.py").write_text(ENV_PLUGIN)
    task = {
        "dataset": {"path": str(data), "prompt_key": "question"},
        "environment": "my_env:Countdown",
        "plugin_paths": [str(plugins)],
        "max_turns": 4,
        "max_context_tokens": 1024,
    }
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False})
    report = _run(stack, config, f"env-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    # every trained trajectory went observation → tool → end, and the tool's result reached it
    assert report["reward_mean_per_step"] == [0.5, 0.5]
    assert report["trajectories_failed_by_code"].get("env_error", 0) >= 1
    assert report["tool_calls"].get("ok", 0) >= 4
    assert (
        report["reward"] == f"{data}: environment my_env:Countdown's reward (episodes it does not score: 0)"
    )


AGENT_PLUGIN = """
import openai

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


async def completions(client, sample):
    \"\"\"Mode `text`: /v1/completions with text prompts, each the last one, the text returned and
    more; mode `ids`: token-id prompts, the context so far and one more token; mode `cut`: as
    `ids`, but the second call drops what the first generated (a new sequence).\"\"\"
    question = sample["question"]
    prompt = question if isinstance(question, str) else question[0]["content"]
    seen = []
    for turn in range(3):
        out = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, logprobs=1, extra_body={"return_token_ids": True}
        )
        choice = out.choices[0]
        context, ids = out.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        assert context[: len(seen)] == seen, "a sampled token changed in the context"
        assert len(ids) == len(choice.logprobs.token_logprobs) <= 6
        seen = context + ids
        if sample["mode"] == "text":
            prompt = prompt + choice.text + f"Go on ({turn}).\\n"
        elif sample["mode"] == "cut" and turn == 0:
            prompt, seen = context + [198], []
        else:
            prompt = seen + [198]
    return 0.5


async def streamed(client, messages):
    \"\"\"Mode `stream`: a chat call streamed, read back into the message, its context and tokens.\"\"\"
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=6, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )
    content, calls, logprobs, context, ids = "", [], [], None, None
    async for chunk in stream:
        if not chunk.choices:
            assert chunk.usage.completion_tokens == len(ids)
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        calls += [c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []]
        logprobs += choice.logprobs.content if choice.logprobs else []
        if choice.finish_reason:
            context, ids = chunk.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert len(ids) == len(logprobs) <= 6
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {k: v for k, v in message.items() if v is not None}, context, ids


async def agent(sample, base_url, api_key):
    \"\"\"Three calls whatever the model writes, checking that every sampled token stays in the context;
    mode `edit` rewrites its history once (a new sequence), mode `raise` has a bug.\"\"\"
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if sample["mode"] in ("text", "ids", "cut"):
        return await completions(client, sample)
    question = sample["question"]
    messages = list(question) if isinstance(question, list) else [{"role": "user", "content": question}]
    seen = []
    for turn in range(3):
        if sample["mode"] == "raise" and turn == 1:
            raise RuntimeError("this agent has a bug")
        if sample["mode"] == "edit" and turn == 1:
            messages, seen = [{"role": "user", "content": "something else"}, *messages[1:]], []
        if sample["mode"] == "stream":
            message, context, ids = await streamed(client, messages)
        else:
            out = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=6, logprobs=True,
                extra_body={"return_token_ids": True},
            )
            choice = out.choices[0]
            context, ids = out.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            assert len(ids) == len(choice.logprobs.content) <= 6
            message = choice.message.model_dump(exclude_none=True)
        assert context[: len(seen)] == seen, "a sampled token changed in the context"
        seen = context + ids
        messages.append(message)
        messages.append({"role": "user", "content": f"Go on ({turn})."})
    return 0.5
"""


def test_your_own_agent_over_the_openai_endpoint_trains_what_it_sampled(stack: Stack, tmp_path: Path) -> None:
    data, plugins = _own_task(tmp_path, ["cut", "edit", "raise", "text", "stream", "edit", "ids", "ok"])
    (plugins / "my_agent.py").write_text(AGENT_PLUGIN)
    task = {
        "dataset": {"path": str(data), "prompt_key": "question"},
        "agent": "my_agent:agent",
        "plugin_paths": [str(plugins)],
        "max_turns": 4,
        "max_context_tokens": 1024,
    }
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False})
    report = _run(stack, config, f"agent-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    assert report["reward_mean_per_step"] == [0.5, 0.5]  # each trained trajectory: the agent's reward
    # the trainer, at the weights that sampled them, computes the logprobs the engines reported: the
    # trained sequence is token for token what the engines saw and sampled
    assert report["logprob_mismatch_per_step"][0] < 1e-3
    assert report["trajectories_failed_by_code"].get("agent_error", 0) >= 1
    assert report["agent_history_rewrites"] >= 1 and "history_edited" not in report["agent_calls_refused"]
    assert report["reward"] == f"{data}: agent my_agent:agent's reward (runs that return None: 0)"
    samples = [json.loads(line) for line in Path(report["samples"]["path"]).read_text().splitlines()]
    trained = [s for s in samples if s["outcome"] == "trained"]
    assert trained and all(s["turns"] == 3 for s in trained)
    said = [e["text"] for s in trained for e in s["events"] if e["role"] == "environment"]
    rewrites = [t for t in said if t.startswith("(conversation rewritten: a new sequence of ")]
    assert rewrites, "no trajectory that rewrote its conversation was trained"
    assert all(t.startswith(("[user] Go on (", "[user] (1 tokens)")) for t in said if t not in rewrites)


def test_a_skyrl_gym_environment_runs_unchanged(stack: Stack, tmp_path: Path) -> None:
    """Rows in SkyRL's dataset format played by skyrl-gym's own `gsm8k_multi_turn` environment: its
    prompt, its observations between turns, its per-turn rewards summed."""
    data = tmp_path / "skyrl.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 3. How many now?"}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(i + 3)},
            "extra_info": {"max_turns": 2},
        }
        for i in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "dataset": {"path": str(data), "prompt_key": "prompt", "answer_key": "reward_spec"},
        "environment": "services.scheduler.skyrl_env:SkyRLGym",
        "max_turns": 3,
        "max_context_tokens": 1024,
    }
    config = _config(tmp_path, task=task, training={"filter_zero_advantage": False})
    report = _run(stack, config, f"skyrl-{RUN}", tmp_path)
    assert report["status"] == "completed", report["reason"]
    assert report["trajectories_failed_by_code"] == {}
    samples = [json.loads(line) for line in Path(report["samples"]["path"]).read_text().splitlines()]
    # the random model never answers '#### N': two turns each, the environment's own nudge between
    assert samples and all(s["turns"] == 2 for s in samples)
    said = [e["text"] for s in samples for e in s["events"] if e["role"] == "environment"]
    assert said and all(t.startswith("Now provide only the final numeric answer") for t in said)


def test_a_stalled_job_times_out_with_what_is_stuck(stack: Stack, tmp_path: Path) -> None:
    """A forged plan sends every turn to engines that do not exist: nothing completes any more."""
    config = _config(tmp_path, job={"stall_timeout_s": 8}, training={"steps": 3})
    ghosts = ["ghost-0", "ghost-1"]

    async def forge_plan(buses: dict[str, Bus]) -> None:
        bus = buses["planner"]  # a planner gone wrong
        for _ in range(600):  # once some trajectory is in flight
            with contextlib.suppress(Exception):  # the scheduler may not answer yet
                stats = await buses["cli"].request(
                    subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, 2
                )
                if stats.trajectories_in_flight:
                    break
            await asyncio.sleep(0.1)
        plan = ev.Plan(
            plan_version=10**9,
            planner_epoch=10**6,  # a lying planner, not a stale one (workers refuse older epochs)
            reason="forged",
            assignments=[ev.Assignment(worker_id=g, role="rollout", bucket="short") for g in ghosts],
        )
        await bus.publish(subjects.PLAN, plan)

    intruder = _meanwhile(stack, f"job-stall-{RUN}", forge_plan)
    report = _run(stack, config, f"job-stall-{RUN}", tmp_path)
    intruder.join(60)

    assert report["status"] == "timed_out", report["reason"]
    assert "stall_timeout_s=8" in report["reason"]
    stuck = report["stuck"]
    assert stuck["scheduler"]["routable_engines"] == ghosts
    assert stuck["scheduler"]["groups_launched"] < stuck["scheduler"]["groups_total"]
    waiting = stuck["scheduler"]["oldest_in_flight"]
    assert {w["engine_id"] for w in waiting if w["state"] == "generating"} <= set(ghosts), waiting
    trainer = stuck["services"]["trainer"]
    assert trainer["state"] == "running" and "step" in trainer and "waiting_groups" in trainer, trainer
    assert report["train_steps"] < 3
    assert report["services_not_stopped"] == []
    # the stack is idle again and takes the next job
    assert stack.dead() == {}
    again = _run(stack, _config(tmp_path), f"job-after-stall-{RUN}", tmp_path)
    assert again["status"] == "completed", again["reason"]


def test_a_killed_service_fails_the_job_with_a_report(tiny_model: Any, tmp_path: Path) -> None:
    """Restarts off: the scheduler is killed mid-job and the report says so (on a stack of its own)."""
    own = Stack(f"e2e-kill-{int(time.time())}", tmp_path / "logs", max_restarts=0)
    own.start_infra(load_run_config(TINY).rollout.engines)
    try:
        own.start_services()
        config = _config(tmp_path, training={"steps": 50})

        async def kill_scheduler(_: dict[str, Bus]) -> None:
            await asyncio.sleep(2.0)
            os.kill(own.procs["scheduler"].pid, signal.SIGKILL)

        intruder = _meanwhile(own, f"job-killed-{RUN}", kill_scheduler, on="scheduler")
        report = _run(own, config, f"job-killed-{RUN}", tmp_path)
        intruder.join(60)
    finally:
        own.stop()
    assert report["status"] == "failed"
    assert "scheduler" in report["reason"] and "-9" in report["reason"], report["reason"]
    assert "restarts are off" in report["reason"]
    assert report["train_steps"] < 50
    assert (tmp_path / f"job-killed-{RUN}" / "report.json").exists()
    assert not [p for p in report["services"].values() if pid_alive(p)], "orphan service processes"


async def _until_trained_version(cli: Bus, version: int, timeout: float = 120) -> None:
    """Until the scheduler has heard of trained version `version` or newer (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            stats = await cli.request(subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, 2)
            if stats.trained_version >= version:
                return
        await asyncio.sleep(0.2)


def test_a_standby_trainer_takes_over_a_dead_one(tiny_model: Any, tmp_path: Path) -> None:
    """Restarts off, one standby: the trainer is killed mid-job; when its lease runs out the planner
    gives the role to the standby, which resumes from the last committed checkpoint."""
    own = Stack(f"e2e-standby-{int(time.time())}", tmp_path / "logs", max_restarts=0)
    own.start_infra(load_run_config(TINY).rollout.engines, standby_trainers=1)
    run_id = f"job-standby-{RUN}"
    try:
        own.start_services()
        config = _config(tmp_path, training={"steps": 6}, job={"lease_ttl_s": 4})

        async def kill_trainer(buses: dict[str, Bus]) -> None:
            await _until_trained_version(buses["cli"], 2)  # once a few steps are committed
            os.kill(own.procs["trainer"].pid, signal.SIGKILL)

        intruder = _meanwhile(own, run_id, kill_trainer, on="trainer")
        report = _run(own, config, run_id, tmp_path)
        intruder.join(60)
        r = redis.Redis.from_url(own.redis_url, decode_responses=True, **own.redis_auth())
        record = r.hgetall(committed_key(run_id))
    finally:
        own.stop()
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 6 and report["all_engines_on_final_version"], report["engines"]
    assert report["services_dead"] == ["trainer"]
    assert record["worker_id"] == "trainer-standby-0", record  # the standby committed the last steps
    assert report["trajectories_trained_twice"] == 0 and report["trajectories_lost"] == 0
    assert Path(report["checkpoint"]).name.startswith("step_00000006-e")


def _events(log: Path, *names: str) -> list[dict[str, Any]]:
    """The JSON log lines of a service log whose event is one of `names`."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if row.get("event") in names:
                out.append(row)
    return out


@pytest.mark.skipif(
    os.environ.get("LIBRA_LONG_TESTS") != "1",
    reason="a long scenario: `make chaos` runs it (LIBRA_LONG_TESTS=1), `make test` does not",
)
def test_a_standby_scheduler_takes_over_and_the_paused_one_is_fenced_out(
    tiny_model: Any, tmp_path: Path
) -> None:
    """Restarts off, one standby scheduler: the active one is paused (SIGSTOP) past its 4 s lease.
    The planner gives the role to the standby, which resumes the job from the ledger; the paused
    one, woken, finds its lease gone, writes nothing more and stands by itself. The job completes,
    nothing lost or trained twice, no process died. Which of the two acts first is the planner's
    choice (the first to register), so the test pauses the one whose log says it leads."""
    own = Stack(f"e2e-sched-standby-{int(time.time())}", tmp_path / "logs", max_restarts=0)
    own.start_infra(load_run_config(TINY).rollout.engines, standby_schedulers=1)
    run_id = f"job-sched-standby-{RUN}"
    logs = tmp_path / "logs"
    schedulers = ["scheduler", "scheduler-standby-0"]
    paused: dict[str, Any] = {}
    try:
        own.start_services()
        config = _config(tmp_path, training={"steps": 30}, job={"lease_ttl_s": 4})

        async def pause_scheduler(buses: dict[str, Bus]) -> None:
            await _until_trained_version(buses["cli"], 2)  # once a few steps are committed
            (active,) = [n for n in schedulers if _events(logs / f"{n}.log", "scheduler_leading")]
            pid = own.procs[active].pid
            os.kill(pid, signal.SIGSTOP)
            paused.update(who=active, at=time.time())
            try:
                await asyncio.sleep(14)  # 3.5 leases: the standby has the role
            finally:
                os.kill(pid, signal.SIGCONT)

        intruder = _meanwhile(own, run_id, pause_scheduler, on="scheduler")
        report = _run(own, config, run_id, tmp_path)
        intruder.join(60)
    finally:
        own.stop()
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 30 and report["services_dead"] == []
    assert report["trajectories_trained_twice"] == 0 and report["trajectories_lost"] == 0
    (standby,) = [n for n in schedulers if n != paused["who"]]
    led = _events(logs / f"{standby}.log", "scheduler_leading")
    assert len(led) == 1, led  # the standby took the role once, while the other was paused
    took_over_s = _timestamp(led[0]) - paused["at"]
    assert 0 < took_over_s < 14, took_over_s
    print(f"standby scheduler leading {took_over_s:.1f} s after the active one was paused")
    original = _events(logs / f"{paused['who']}.log", "scheduler_fenced_out", "job_rejoined_as_standby")
    assert [e["event"] for e in original][-1] == "job_rejoined_as_standby", original
    assert _timestamp(original[0]) > paused["at"] + 14  # only once it was woken


def _timestamp(row: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()


def test_an_engine_killed_while_joining_training_costs_one_attempt_and_the_job_goes_on(
    tiny_model: Any, tmp_path: Path
) -> None:
    """An engine moved into training is killed -9 the moment the trainer announces the generation
    it is to join: the trainer's rendezvous times out (5 s here), it trains on alone, the engine
    comes back (restarted) into rollout, and the job completes with nothing lost or trained twice."""
    env = {"LIBRA_TRAINER_HYBRID_TIMEOUT_S": "5"}
    own = Stack(f"e2e-hybrid-kill-{int(time.time())}", tmp_path / "logs", extra_env=env)
    own.start_infra(load_run_config(TINY).rollout.engines)
    run_id = f"job-hybrid-kill-{RUN}"
    killed: list[int] = []
    try:
        own.start_services()
        config = _config(tmp_path, training={"steps": 6})

        async def kill_mid_join(buses: dict[str, Bus]) -> None:
            announced = asyncio.Event()

            async def on_group(g: ev.HybridGroup, _: Envelope) -> None:
                if "rollout-engine-0" in g.members and not killed:
                    os.kill(own.procs["rollout-engine-0"].pid, signal.SIGKILL)
                    killed.append(g.generation)
                    announced.set()

            await buses["cli"].subscribe(subjects.HYBRID_GROUP, ev.HybridGroup, on_group)
            await _until_completed(buses["cli"])
            req = ev.RoleChange(worker_id="rollout-engine-0", to_role="hybrid")
            await buses["cli"].request(subjects.ROLE_REQUEST, req, ev.RoleChange, 10)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(announced.wait(), 120)

        intruder = _meanwhile(own, run_id, kill_mid_join, on="rollout-engine-0")
        report = _run(own, config, run_id, tmp_path)
        intruder.join(180)
        trainer_log = (tmp_path / "logs" / "trainer.log").read_text()
    finally:
        own.stop()
    assert killed, "the generation with the engine was never announced"
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 6
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    assert "hybrid_group_failed" in trainer_log, "the trainer gave up on the generation"
    into = report["role_changes"][0]
    assert (into["worker"], into["to"], into["seconds"]) == ("rollout-engine-0", "hybrid", None), into


def test_a_job_needing_more_engines_than_the_stack_runs_fails_at_once(stack: Stack, tmp_path: Path) -> None:
    """`--rollout.engines 3` on a 2-engine stack: a failed report naming both numbers, at once
    (not after the services' wait), and the stack stays idle for the next job."""
    config = _config(tmp_path, rollout={"engines": 3})
    started = time.monotonic()
    report = _run(stack, config, f"job-too-big-{RUN}", tmp_path)
    assert report["status"] == "failed", report
    assert "needs 3 rollout engine(s)" in report["reason"] and "runs 2" in report["reason"], report["reason"]
    assert "--rollout.engines 2" in report["reason"]
    assert time.monotonic() - started < 60  # not the 120 s wait for services that never come
