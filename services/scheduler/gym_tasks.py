"""Tasks our users already have, run unchanged: reasoning-gym's procedural datasets as `task.dataset`
(`{reasoning_gym: NAME, size, seed, config}`), each row scored by its task's own scorer; and the
`math_verify` reward. Both come with the `environments` extra; the rewards run in reward worker
processes like a user's (`task.reward: reasoning_gym | math_verify`), so a scorer that hangs or
raises fails only its trajectory."""

from __future__ import annotations

import importlib
import json
from typing import Any

from services.common.runconfig import ReasoningGymDataset
from services.scheduler.datasets import DatasetError
from services.scheduler.task import Task

EXTRA = "pip install 'libra[environments]'"
EXAMPLE_SEED = 1_000_003
"""Offset of the seed that draws the worked examples (never the training samples' seed)."""


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise DatasetError(f"{name} is not installed ({e}): {EXTRA}") from None


def _dataset(name: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    rg = _module("reasoning_gym")
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise DatasetError(f"task.dataset.reasoning_gym {name!r}: {type(e).__name__}: {e}") from None


def gym_tasks(spec: ReasoningGymDataset) -> list[Task]:
    """The task's samples as Libra tasks: its question as the user's message after the system
    prompt, its answer as the reference, and the whole entry (with what rebuilds the task) as the
    row the reward gets."""
    data = _dataset(spec.reasoning_gym, spec.size, spec.seed, spec.config)
    system = spec.system_prompt
    if system is None:
        system = _module("reasoning_gym.utils").SYSTEM_PROMPTS["default"]
    made = {"name": spec.reasoning_gym, "size": spec.size, "seed": spec.seed, "config": spec.config}
    shots: list[dict[str, str]] = []
    if spec.examples:
        solved = _dataset(spec.reasoning_gym, spec.examples, spec.seed + EXAMPLE_SEED, spec.config)
        for j in range(len(solved)):
            shots += [
                {"role": "user", "content": str(solved[j]["question"])},
                {"role": "assistant", "content": f"<answer>{solved[j]['answer']}</answer>"},
            ]
    tasks = []
    for i in range(len(data)):
        entry = data[i]
        row = json.loads(
            json.dumps({k: entry.get(k) for k in ("question", "answer", "metadata")}, default=str)
        )
        row["reasoning_gym"] = made
        tasks.append(
            Task(
                prompt_id=f"rg-{spec.reasoning_gym}-{spec.seed}-{i}",
                question=row["question"],
                answer=row["answer"],
                messages=(
                    {"role": "system", "content": system},
                    *shots,
                    {"role": "user", "content": row["question"]},
                ),
                sample=row,
            )
        )
    return tasks


_made: dict[str, Any] = {}


def reasoning_gym_score(response: str, sample: dict[str, Any], trajectory: dict[str, Any], **_: Any) -> float:
    """The task's own score of the response's last `<answer>` tag (0 without one)."""
    made = sample["reasoning_gym"]
    key = json.dumps(made, sort_keys=True)
    if key not in _made:
        _made[key] = _dataset(made["name"], made["size"], made["seed"], made["config"])
    answer = _module("reasoning_gym.utils").extract_answer(response)
    if answer is None:
        return 0.0
    entry = {k: sample.get(k) for k in ("question", "answer", "metadata")}
    return float(_made[key].score_answer(answer=answer, entry=entry))


def math_verify_score(
    response: str, sample: dict[str, Any], trajectory: dict[str, Any], answer: Any = None
) -> float:
    """1 when math-verify finds the response's final answer equal to the reference (LaTeX, plain
    numbers and expressions alike), else 0."""
    mv = _module("math_verify")
    reference = str(answer if answer is not None else sample.get("answer", ""))
    gold = mv.parse(reference) or mv.parse(f"${reference}$")
    return float(bool(gold) and mv.verify(gold, mv.parse(response)))
