"""Datasets by name from the local Hugging Face cache (`task.dataset: hf:NAME`, or `{hf, split,
subset, prompt_key, answer_key}`): a cache laid out as huggingface_hub lays it out, here, with
Parquet files per subset and split (as `openai/gsm8k`) and JSONL under `data/`; the split's rows
become tasks with the columns mapped; an absent dataset, split or subset is a clear error naming
where it looked, raised by `libra config check` before anything starts. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from services.common.runconfig import HubDataset, RunConfig, TaskConfig
from services.scheduler.datasets import DatasetError
from services.scheduler.feed import task_list
from tools.stack import ROOT

pytestmark = pytest.mark.integration


def _snapshot(hub: Path, repo: str, commit: str = "0123abcd") -> Path:
    root = hub / f"datasets--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    return snap


def _parquet(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hub = tmp_path / "hub"
    snap = _snapshot(hub, "acme/grade-math")
    for subset in ("main", "socratic"):
        for split, n in (("train", 5), ("test", 3)):
            rows = [
                {"question": f"{subset} {split} {i}: 2+{i}?", "answer": f"#### {2 + i}"} for i in range(n)
            ]
            _parquet(snap / subset / f"{split}-00000-of-00001.parquet", rows)
    (snap / "README.md").write_text("---\nconfigs: []\n---\n")
    flat = _snapshot(hub, "acme/flat")
    (flat / "data").mkdir()
    for split in ("train", "validation"):
        lines = [
            json.dumps({"prompt": f"{split} {i}", "answer": str(i), "id": f"{split}{i}"}) for i in range(4)
        ]
        (flat / "data" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def test_a_split_of_a_subset_becomes_tasks_with_its_columns_mapped(hub: Path) -> None:
    spec = {"hf": "acme/grade-math", "subset": "main", "split": "test", "prompt_key": "question"}
    tasks = task_list(TaskConfig.model_validate({"dataset": spec}))
    assert [t.question for t in tasks] == [f"main test {i}: 2+{i}?" for i in range(3)]
    assert [t.answer for t in tasks] == ["#### 2", "#### 3", "#### 4"]
    assert tasks[0].prompt_id == "grade-math-test-0" and tasks[0].sample["question"] == tasks[0].question

    short = TaskConfig.model_validate({"dataset": "hf:acme/flat"})  # the shorthand: split train
    assert short.dataset == HubDataset(hf="acme/flat")
    flat = task_list(TaskConfig.model_validate({"dataset": {"hf": "acme/flat", "id_key": "id"}}))
    assert [t.prompt_id for t in flat] == [f"flat-train-train{i}" for i in range(4)]
    assert (
        task_list(TaskConfig.model_validate({"dataset": {"hf": "acme/flat", "split": "validation"}}))[
            0
        ].answer
        == "0"
    )
    # a held-out evaluation from another split of the same dataset
    run = RunConfig.model_validate(
        {
            "task": {"dataset": "hf:acme/flat"},
            "eval": {"every": 1, "dataset": {"hf": "acme/flat", "split": "validation"}},
        }
    )
    assert run.eval.dataset == HubDataset(hf="acme/flat", split="validation")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"hf": "acme/absent"},
            r"not in the local Hugging Face cache \(.*hub/datasets--acme--absent; nothing is downloaded\)",
        ),
        ({"hf": "acme/grade-math"}, r"has subsets \['main', 'socratic'\]: name one \(task.dataset.subset\)"),
        ({"hf": "acme/grade-math", "subset": "other"}, r"no subset 'other'"),
        (
            {"hf": "acme/flat", "split": "test"},
            r"no data files of split 'test' in .*names there: \['data', 'train', 'validation'\]",
        ),
        ({"hf": "acme/flat", "prompt_key": "question"}, r"data/train.jsonl:1: no key 'question'"),
    ],
)
def test_what_is_missing_is_named(hub: Path, spec: dict[str, str], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        task_list(TaskConfig.model_validate({"dataset": spec}))


def test_config_check_refuses_an_absent_hub_dataset_before_anything_starts(hub: Path, tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"task": {"dataset": "hf:acme/absent", "max_turns": 1}}))
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "tools.cli", "config", "check", str(config)]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "datasets--acme--absent" in out.stderr
        and "huggingface-cli download --repo-type dataset" in out.stderr
    )
    assert "Traceback" not in out.stderr
