"""Rollout samples: a trajectory's text bounded as the scheduler sends it, the selection `libra run`
writes (every group of the first and last steps, `job.samples_per_step` of the others, and that
many untrained groups), with the advantage each trained with, and `libra samples` reading them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.contracts import ev
from services.common.runconfig import RunConfig
from services.scheduler.transcript import SAMPLE_LIMIT, TEXT_LIMIT, Transcript, prompt_of
from tools.samples import SampleStore, read, render, select, write


def test_a_transcript_keeps_each_turn_and_tool_call_within_its_bounds() -> None:
    t = Transcript()
    t.assistant("<calc>2+3</calc>", 7, [1, 1, 2], "stop")
    t.tool("calculator", {"expression": "2+3", "note": "x" * 5000}, "ok", '{"result": "5"}')
    t.tool(
        "teleport", {}, "rejected", '{"stderr": "tool \'teleport\' is not enabled; available: calculator"}'
    )
    t.environment("y" * 10_000)
    body = json.loads(t.to_json({"reward": 1.0}))
    turn, ok, rejected, env = body["events"]
    assert (turn["policy_versions"], turn["tokens"]) == ([1, 2], 7)
    assert ok["args"]["expression"] == "2+3" and ok["args"]["note"].endswith("[3000 more characters]")
    assert rejected["status"] == "rejected" and "is not enabled" in rejected["returned"]
    assert len(env["text"]) < TEXT_LIMIT + 40
    for _ in range(200):  # far past the size bound: the latest events go, and are counted
        t.environment("z" * TEXT_LIMIT)
    out = t.to_json({"reward": 0.0})
    assert len(out.encode()) <= SAMPLE_LIMIT and json.loads(out)["events_dropped"] > 0
    assert prompt_of(None, "What is 2+3?") == [{"role": "user", "content": "What is 2+3?"}]


def _store(per_group: int = 2) -> SampleStore:
    store = SampleStore()
    steps = {"g1": 1, "g2": 1, "g3": 2, "g4": 2, "g5": 3, "g6": 3}
    for gid in [*steps, "gx"]:
        for i in range(per_group):
            body = {"reward": float(i), "finish": "answer", "events": [], "prompt": [], "turns": 1}
            if gid == "gx" and i == 1:
                body |= {"finish": "error", "failure": "engine_unavailable: no engine answered"}
            store.add(
                ev.TrajectorySample(
                    trajectory_id=f"{gid}-{i}", group_id=gid, transcript_json=json.dumps(body)
                )
            )
    for gid, step in steps.items():
        store.outcome(ev.GroupOutcome(group_id=gid, outcome="trained", train_step=step))
    store.outcome(ev.GroupOutcome(group_id="gx", outcome="failed", reason="gx-1: engine_unavailable"))
    return store


def test_the_selection_keeps_the_first_and_last_steps_whole_and_samples_the_rest() -> None:
    cfg = RunConfig.model_validate({"job": {"samples_per_step": 1}, "training": {"advantage": "grpo"}})
    rows = select(_store(), cfg)
    groups = [(r["step"], r["group_id"]) for r in rows]
    assert sorted(set(groups), key=str) == sorted(
        {(1, "g1"), (1, "g2"), (2, "g3"), (3, "g5"), (3, "g6"), (None, "gx")}, key=str
    )
    trained = [r for r in rows if r["outcome"] == "trained"]
    assert {r["advantage"] for r in trained} == {-1.0, 1.0}  # grpo of rewards 0 and 1
    failed = [r for r in rows if r["group_id"] == "gx"]
    assert all(r["advantage"] is None and r["outcome"] == "failed" for r in failed)
    none = RunConfig.model_validate({"job": {"samples_per_step": 0}})
    assert {r["group_id"] for r in select(_store(), none)} == {"g1", "g2", "g5", "g6"}


def test_libra_samples_prints_them_worst_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    t = Transcript()
    t.assistant("<calc>2+3</calc>", 7, [0], "stop")
    t.tool("calculator", {"expression": "2+3"}, "ok", '{"result": "5"}')
    t.assistant("The answer is <answer>5</answer>", 9, [0], "stop")
    store = _store()
    store.held["g1-0"].update(
        json.loads(t.to_json({"prompt": [{"role": "user", "content": "What is 2+3?"}]}))
    )
    cfg = RunConfig.model_validate({})
    run = tmp_path / "r1"
    run.mkdir()
    assert write(run / "samples.jsonl", select(store, cfg)) == len(read(run / "samples.jsonl"))
    text = render(next(r for r in read(run / "samples.jsonl") if r["trajectory_id"] == "g1-0"))
    assert '[tool calculator {"expression": "2+3"} → ok] {"result": "5"}' in text
    assert "[user] What is 2+3?" in text and "advantage -1.000" in text
    assert main(["samples", "r1", "--output-dir", str(tmp_path), "--worst", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "gx-" in out.splitlines()[0] and "engine_unavailable" in out  # the failed group first
    assert main(["samples", "r1", "--output-dir", str(tmp_path), "--step", "3"]) == 0
    assert "step 3" in capsys.readouterr().out
    assert main(["samples", "nope", "--output-dir", str(tmp_path)]) == 2
