"""Dataset files: rows become tasks with chat prompts and their whole row; a bad file or row is a
clear error naming the file and the row."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from services.common.runconfig import DatasetFile, RunConfig, load_run_config
from services.scheduler.datasets import DatasetError, file_tasks
from services.scheduler.feed import build_feed, task_list
from services.scheduler.rewards import check_reward
from tools.stack import ROOT


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_and_chat_prompts_become_messages_and_the_row_travels(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"q": "What is 2+2?", "a": "4", "level": 1},
            {
                "q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
                "a": "hi",
            },
        ],
    )
    tasks = file_tasks(DatasetFile(path=str(path), prompt_key="q", answer_key="a", system_prompt="Sys."))
    assert [t.prompt_id for t in tasks] == ["d-0", "d-1"]
    assert tasks[0].messages == (
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "What is 2+2?"},
    )
    assert tasks[1].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
    )
    assert tasks[0].row() == {"q": "What is 2+2?", "a": "4", "level": 1}
    assert tasks[0].answer == "4" and tasks[1].question == "Hi?"


def test_parquet_and_json_read_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"p{i}", "answer": i, "id": f"x{i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.parquet", "d.json"):
        tasks = file_tasks(DatasetFile(path=str(tmp_path / name), id_key="id"))
        assert [(t.prompt_id, t.answer, t.row()) for t in tasks] == [
            (f"d-x{i}", i, rows[i]) for i in range(3)
        ]


@pytest.mark.parametrize(
    ("content", "spec", "message"),
    [
        ('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n', {}, "d.jsonl:2: no key 'answer'"),
        ('{"prompt": "a", "answer": 1}\nnot json\n', {}, "d.jsonl:2: not valid JSON"),
        ('{"prompt": "", "answer": 1}\n', {}, "d.jsonl:1: the prompt is empty"),
        ('{"prompt": [{"role": "user"}], "answer": 1}\n', {}, "a chat message must be"),
        (
            '{"prompt": [{"role": "assistant", "content": "x"}], "answer": 1}\n',
            {},
            "the model would answer itself",
        ),
        ("[1, 2]\n", {}, "a sample is an object"),
        (
            '{"prompt": "a", "answer": 1, "id": 1}\n{"prompt": "b", "answer": 2, "id": 1}\n',
            {"id_key": "id"},
            "duplicate id '1'",
        ),
        ("", {}, "the dataset has no rows"),
    ],
)
def test_a_bad_row_names_the_file_and_row(tmp_path: Path, content: str, spec: dict, message: str) -> None:
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[")):
        file_tasks(DatasetFile(path=str(tmp_path / "d.jsonl"), **spec))


def test_a_missing_or_unknown_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such dataset file"):
        file_tasks(DatasetFile(path=str(tmp_path / "none.jsonl")))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'"):
        file_tasks(DatasetFile(path=str(tmp_path / "d.csv")))
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        file_tasks(DatasetFile(path=str(tmp_path / "d.parquet")))


def test_num_prompts_takes_the_first_rows_only_when_set(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(10)])
    every = RunConfig.model_validate({"task": {"dataset": {"path": str(path)}}})
    assert len(build_feed(every.task, every.training).tasks) == 10
    first = RunConfig.model_validate({"task": {"dataset": {"path": str(path)}, "num_prompts": 4}})
    assert [t.answer for t in build_feed(first.task, first.training).tasks] == [0, 1, 2, 3]


def test_reward_refs_are_checked_by_the_config() -> None:
    RunConfig.model_validate({"task": {"reward": "my_pkg.rewards:score"}})
    RunConfig.model_validate({"task": {"reward": "exact_match"}})
    RunConfig.model_validate({"task": {"reward": "code_tests"}})
    with pytest.raises(ValueError, match="reward"):
        RunConfig.model_validate({"task": {"reward": "not a ref"}})
    with pytest.raises(ValueError, match="does not apply"):
        RunConfig.model_validate(
            {"task": {"dataset": "synthetic", "workload": "r2e_gym", "reward": "exact_match"}}
        )
    with pytest.raises(ValueError, match="task.agent drives its own turns"):
        RunConfig.model_validate({"task": {"agent": "my:agent", "environment": "my:Env"}})
    with pytest.raises(ValueError, match="String should match pattern"):
        RunConfig.model_validate({"task": {"agent": "not a function"}})
    with pytest.raises(ValueError, match="name two agents"):
        RunConfig.model_validate({"task": {"agent": "my:agent", "agent_command": ["./agent"]}})
    with pytest.raises(ValueError, match="task.agent drives its own turns"):
        RunConfig.model_validate({"task": {"agent_command": ["./agent"], "environment": "my:Env"}})
    with pytest.raises(ValueError, match="no task.environment to take them"):
        RunConfig.model_validate({"task": {"environment_args": {"url": "http://env:8000"}}})
    RunConfig.model_validate(
        {"task": {"environment": "my:Env", "environment_args": {"url": "http://env:8000"}}}
    )


# verifiers_example.yaml's taskset is listed by tests/integration/test_verifiers.py, from another
# directory too (its listing process imports verifiers: 20 s of a make test near its budget)
@pytest.mark.parametrize(
    "config",
    sorted(c for c in (ROOT / "configs").glob("*.yaml") if c.name != "verifiers_example.yaml"),
    ids=lambda p: p.name,
)
def test_every_shipped_config_has_a_task_that_loads(
    config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its dataset reads and its reward imports (configs/custom_example.yaml: examples/custom), from
    any directory: a config's relative paths are its own."""
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(config)
    assert task_list(cfg.task)
    asyncio.run(check_reward(cfg.task))


def test_the_example_reward_scores_a_trajectory() -> None:
    sys.path.insert(0, str(ROOT / "examples" / "custom"))
    try:
        from unit_reward import score  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    ok = {"tool_calls": [{"tool": "calculator", "status": "ok"}], "turns": []}
    assert score("<answer>6,540</answer>", {"answer": 6540}, ok) == {"score": 1.05, "used_tool": True}
    assert score("6540", {"answer": 6540}, {"tool_calls": [], "turns": []})["score"] == 0.0
