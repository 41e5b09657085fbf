"""Property: every run config that validates gives a scheduler a feed whose tasks are all well formed.

The ranges come from the config models themselves, so a bound changed there is tested here."""

from __future__ import annotations

from typing import Any

from annotated_types import Ge, Gt, Le
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from services.common.runconfig import RunConfig, TaskConfig, TrainingConfig
from services.scheduler.feed import build_feed
from services.scheduler.task import score

# Generation is eager: cap the sizes the property explores (the config's own caps are larger).
EXPLORE_CAP = {"num_prompts": 3000, "steps": 50, "groups_per_step": 64, "group_size": 64}


def _strategy(model: type[BaseModel], name: str) -> st.SearchStrategy[Any] | None:
    field = model.model_fields[name]
    lo: float | None = None
    hi: float | None = None
    for m in field.metadata:
        if isinstance(m, Ge):
            lo = float(m.ge)  # type: ignore[arg-type]
        elif isinstance(m, Gt):
            lo = float(m.gt) + 1e-6  # type: ignore[arg-type]
        elif isinstance(m, Le):
            hi = float(m.le)  # type: ignore[arg-type]
    if field.annotation is int:
        top = min(int(hi) if hi is not None else 10**6, EXPLORE_CAP.get(name, 10**6))
        return st.integers(int(lo) if lo is not None else -(10**6), top)
    if field.annotation is float:
        return st.floats(lo if lo is not None else 0.0, hi if hi is not None else 1e3)
    return None


def _section(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    fields = {n: s for n in model.model_fields if (s := _strategy(model, n)) is not None}
    if model is TaskConfig:
        fields["dataset"] = st.sampled_from(["arithmetic", "expressions"])
    return st.fixed_dictionaries(fields)


@settings(max_examples=60, deadline=None)
@given(task=_section(TaskConfig), training=_section(TrainingConfig))
def test_every_valid_config_generates_its_tasks(task: dict[str, Any], training: dict[str, Any]) -> None:
    cfg = RunConfig.model_validate({"model": {"source": "tiny-random"}, "task": task, "training": training})
    feed = build_feed(cfg.task, cfg.training)
    assert len(feed.tasks) == cfg.task.num_prompts
    tickets = feed.take(trained_version=cfg.training.steps)
    assert len(tickets) == cfg.training.groups_per_step * cfg.training.steps
    assert feed.exhausted
    for t in feed.tasks:
        assert t.question and t.answer > 0, t
        assert (
            score(f"<answer>{t.answer}</answer>", t.answer, tool_ok=0, tool_bonus=cfg.task.tool_bonus) == 1.0
        )


def test_the_prompt_count_that_crashed_the_scheduler() -> None:
    """num_prompts >= 70 at seed 0 drew an empty range for `a` in `a - b*c` (b*c up to 108)."""
    cfg = RunConfig.model_validate({"task": {"num_prompts": 500, "seed": 0}})
    assert all(t.answer > 0 for t in build_feed(cfg.task, cfg.training).tasks)
