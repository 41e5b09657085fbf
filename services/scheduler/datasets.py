"""Datasets of your own (`task.dataset: {path, prompt_key, answer_key}`, or a Hub dataset from the
local Hugging Face cache, `hf:NAME` / `{hf, split, subset, ...}`): JSONL, JSON or Parquet rows
become tasks whose prompt is chat messages and whose row travels with the sample to the reward.

Every row is checked when the file is read, so a bad file or a missing key stops the run before it
starts (`libra run` reads it first), with the file, the row and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.hf_cache import repo_dir, snapshot
from services.common.runconfig import DatasetFile, HubDataset
from services.scheduler.task import Task

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset file that cannot be trained on; the message names the file and the row."""


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every sample; `where` is `file:line` or `file[row]` for messages."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; use one of {sorted(FORMATS)}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise DatasetError(f"{path}: reading Parquet needs pyarrow ({e})") from e
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise DatasetError(f"{path}: not a readable Parquet file: {e}") from e
        return [(f"{path}[{i}]", r) for i, r in enumerate(rows)]
    text = path.read_text(encoding="utf-8")
    if fmt == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a JSON dataset is a list of objects, got {type(data).__name__}")
        return [(f"{path}[{i}]", r) for i, r in enumerate(data)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not valid JSON: {e}") from e
    return out


def _messages(where: str, value: Any, system: str | None) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: the prompt is empty")
        msgs = [{"role": "user", "content": value}]
        return tuple(([{"role": "system", "content": system}] if system else []) + msgs)
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: the prompt must be text or a non-empty list of chat messages")
    out = []
    for m in value:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
            or m["role"] not in ("system", "user", "assistant", "tool")
        ):
            raise DatasetError(
                f"{where}: a chat message must be {{role: system|user|assistant|tool, content: text}}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise DatasetError(
            f"{where}: the prompt's last message is the assistant's; the model would answer itself"
        )
    return tuple(out)


def _split_of(rel: Path, split: str) -> bool:
    """Whether a repository file belongs to `split`: a directory of its name on the way, or a file
    named after it (`train.jsonl`, `train-00000-of-00001.parquet`), as the Hub's data files are."""
    if split in rel.parts[:-1]:
        return True
    name = rel.name
    return name.startswith(split) and (len(name) == len(split) or name[len(split)] in "-._")


def hub_files(spec: HubDataset) -> list[Path]:
    """The data files of `spec`'s split (and subset) in the local Hugging Face cache, in name order;
    a DatasetError says what is missing and where it looked."""
    where = f"task.dataset hf:{spec.hf}"
    snap = snapshot(spec.hf, "dataset")
    if snap is None:
        raise DatasetError(
            f"{where}: not in the local Hugging Face cache ({repo_dir(spec.hf, 'dataset')}; nothing is "
            f"downloaded). Put it there (`huggingface-cli download --repo-type dataset {spec.hf}` on a "
            "machine with network, then copy the cache), or set HF_HUB_CACHE to the cache that has it"
        )
    data = sorted(p.relative_to(snap) for p in snap.rglob("*") if p.suffix.lower() in FORMATS and p.is_file())
    if spec.subset is not None:
        data = [p for p in data if p.parts[0] == spec.subset]
        if not data:
            raise DatasetError(
                f"{where}: no subset {spec.subset!r} (no data files under {snap / spec.subset})"
            )
    files = [p for p in data if _split_of(p, spec.split)]
    if not files:
        splits = sorted(
            {p.name.split("-")[0].split(".")[0] for p in data} | {d for p in data for d in p.parts[:-1]}
        )
        raise DatasetError(
            f"{where}: no data files of split {spec.split!r} in {snap} (names there: {splits})"
        )
    subsets = sorted({p.parts[0] for p in files if len(p.parts) > 1} - {"data", spec.split})
    if spec.subset is None and len(subsets) > 1:
        raise DatasetError(f"{where}: the dataset has subsets {subsets}: name one (task.dataset.subset)")
    return [snap / p for p in files]


def _rows(spec: DatasetFile | HubDataset) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The dataset's name (its prompt ids' prefix) and its rows."""
    if isinstance(spec, DatasetFile):
        path = Path(spec.path)
        rows = read_rows(path)
        if not rows:
            raise DatasetError(f"{path}: the dataset has no rows")
        return path.stem, rows
    rows = [row for f in hub_files(spec) for row in read_rows(f)]
    if not rows:
        raise DatasetError(f"task.dataset hf:{spec.hf}: split {spec.split!r} has no rows")
    return f"{spec.hf.split('/')[-1]}-{spec.split}", rows


def file_tasks(spec: DatasetFile | HubDataset, limit: int | None = None) -> list[Task]:
    """The tasks of a dataset (the first `limit` rows when given), every row checked."""
    name, rows = _rows(spec)
    tasks: list[Task] = []
    seen: set[str] = set()
    for i, (where, row) in enumerate(rows[:limit] if limit else rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: a sample is an object, got {type(row).__name__}")
        for key in (spec.prompt_key, spec.answer_key, *([spec.id_key] if spec.id_key else [])):
            if key not in row:
                raise DatasetError(f"{where}: no key {key!r} (keys: {sorted(row)})")
        messages = _messages(where, row[spec.prompt_key], spec.system_prompt)
        sample_id = str(row[spec.id_key]) if spec.id_key else str(i)
        if sample_id in seen:
            raise DatasetError(f"{where}: duplicate {spec.id_key} {sample_id!r}")
        seen.add(sample_id)
        try:
            json.dumps(row, default=str)
        except (TypeError, ValueError) as e:  # pragma: no cover - rows come from JSON or Arrow
            raise DatasetError(f"{where}: the row cannot be passed to a reward: {e}") from e
        question = next(
            (m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"]
        )
        tasks.append(
            Task(
                prompt_id=f"{name}-{sample_id}",
                question=question,
                answer=row[spec.answer_key],
                messages=messages,
                sample=row,
            )
        )
    return tasks
