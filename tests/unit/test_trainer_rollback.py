"""A trainer whose commit was refused (its lease moved on) goes back to the last committed step:
later checkpoints are deleted and the committed weights and ids are loaded again."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.runconfig import ModelConfig, RunConfig
from services.trainer.checkpoint import latest, newer_than
from services.trainer.learner import Learner


def test_rollback_to_the_committed_step(tiny_model: ModelConfig, tmp_path: Path) -> None:
    run = RunConfig(model=tiny_model)
    learner = Learner(run, tmp_path, keep_checkpoints=3)
    initial = learner.model.get_input_embeddings().weight.detach().clone()
    learner.commit({"a"})
    with torch.no_grad():
        learner.model.get_input_embeddings().weight.add_(1.0)
    learner.commit({"b"})
    learner.commit({"c"})
    assert [p.name for p in newer_than(tmp_path, 1)] == ["step_00000002.pt", "step_00000003.pt"]

    path = learner.rollback(1)  # Redis says step 1 is the last committed one
    assert path is not None and path.name == "step_00000001.pt" and latest(tmp_path) == path
    assert (learner.state.step, learner.state.version, learner.state.trained_ids) == (1, 1, {"a"})
    assert torch.equal(learner.model.get_input_embeddings().weight, initial)  # step 1's weights

    assert learner.rollback(0) is None  # nothing committed at all: the initial weights
    assert learner.state.step == 0 and latest(tmp_path) is None
