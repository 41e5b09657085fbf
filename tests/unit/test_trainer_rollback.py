"""A trainer whose commit was refused (its lease moved on) goes back to the last committed step:
later checkpoints are deleted and the committed weights and ids are loaded again. Checkpoints carry
the writer's epoch (fencing token), so a stale trainer never overwrites its successor's."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.checkpoint import checkpoints, latest, newer_than
from services.learning.learner import Learner


def _run(model: ModelConfig, keep: int = 2) -> RunConfig:
    """Every step's checkpoint full (`training.checkpoint_every: 1`), the newest `keep` kept."""
    return RunConfig.model_validate(
        {"model": model.model_dump(), "training": {"checkpoint_every": 1, "keep_checkpoints": keep}}
    )


def _names(directory: Path) -> list[str]:
    return [p.name for p in checkpoints(directory)]


def test_rollback_to_the_committed_step(tiny_model: ModelConfig, tmp_path: Path) -> None:
    run = _run(tiny_model, keep=3)
    learner = Learner(LearnJob.of(run), tmp_path)
    initial = learner.model.get_input_embeddings().weight.detach().clone()
    learner.commit({"a"}, epoch=4)
    with torch.no_grad():
        learner.model.get_input_embeddings().weight.add_(1.0)
    learner.commit({"b"}, epoch=4)
    learner.commit({"c"}, epoch=4)
    assert [p.name for p in newer_than(tmp_path, 1)] == ["step_00000002-e4.pt", "step_00000003-e4.pt"]

    path = learner.rollback(1)  # Redis says step 1 is the last committed one
    assert path is not None and path.name == "step_00000001-e4.pt" and latest(tmp_path) == path
    assert (learner.state.step, learner.state.version, learner.state.trained_ids) == (1, 1, {"a"})
    assert torch.equal(learner.model.get_input_embeddings().weight, initial)  # step 1's weights
    assert learner.loaded == path

    assert learner.rollback(0) is None  # nothing committed at all: the initial weights
    assert learner.state.step == 0 and latest(tmp_path) is None and learner.loaded is None


def test_a_stale_trainer_cannot_clobber_its_successor(tiny_model: ModelConfig, tmp_path: Path) -> None:
    run = _run(tiny_model)
    old, new = Learner(LearnJob.of(run), tmp_path), Learner(LearnJob.of(run), tmp_path)
    old.commit({"a"}, epoch=5)  # committed under epoch 5
    committed = new.rollback(1, str(tmp_path / "step_00000001-e5.pt"))  # the standby takes over
    assert committed is not None and new.state.trained_ids == {"a"}
    with torch.no_grad():
        new.model.get_input_embeddings().weight.add_(2.0)
    successor = new.commit({"b"}, epoch=6)  # epoch 6 commits step 2
    mark = new.model.get_input_embeddings().weight.detach().clone()

    stale = old.commit({"x"}, epoch=5)  # the paused old trainer wakes up and writes step 2 too
    assert stale != successor and successor.exists()
    # its fenced commit is refused; it goes back to what the record names: the successor's step 2
    old.rollback(2, str(successor))
    assert not stale.exists() and old.state.trained_ids == {"a", "b"}
    assert torch.equal(old.model.get_input_embeddings().weight, mark)


def test_pruning_keeps_the_last_committed_checkpoint_of_any_epoch(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    run = _run(tiny_model)
    first = Learner(LearnJob.of(run), tmp_path)
    for ids in ({"a"}, {"b"}, {"c"}):
        first.commit(ids, epoch=1)
    assert _names(tmp_path) == ["step_00000002-e1.pt", "step_00000003-e1.pt"]
    second = Learner(LearnJob.of(run), tmp_path)
    second.rollback(3, str(tmp_path / "step_00000003-e1.pt"))
    second.commit({"d"}, epoch=2)  # not committed yet: epoch 1's step 3 must survive
    assert _names(tmp_path) == ["step_00000002-e1.pt", "step_00000003-e1.pt", "step_00000004-e2.pt"]
    second.commit({"e"}, epoch=2)  # step 4 committed before step 5 was written: older epochs go
    assert _names(tmp_path) == ["step_00000004-e2.pt", "step_00000005-e2.pt"]
