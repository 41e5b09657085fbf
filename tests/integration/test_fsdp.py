"""FSDP for real: the trainer's policy sharded over two processes (gloo on the CPU, as on GPUs with
NCCL), stepping as the unsharded trainer does — same weights after each step to float tolerance,
uneven micro-batch shares padded, the KL reference sharded too — with checkpoints an unsharded
trainer resumes from (and the other way round), rollback to the initial weights, and the full
weights for a push and the Hugging Face export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.data import Sample
from services.learning.learner import Learner
from tests.learning_samples import random_groups

pytestmark = pytest.mark.integration


def _run(model: ModelConfig, fsdp: int) -> RunConfig:
    training = {"fsdp": fsdp, "micro_batch": 1, "mini_batches": 2, "torch_threads": 1, "kl_coef": 0.05}
    training |= {"lr": 1e-3, "steps": 4, "checkpoint_every": 1}  # resumes take the optimizer state
    return RunConfig.model_validate({"model": model.model_dump(), "training": training})


def _samples(seed: int, version: int = 0) -> list[Sample]:
    """Two groups of three, of different lengths: three micro-batches per mini-batch, so one rank
    of two computes two and the other one (plus a padding pass)."""
    return random_groups(seed, version)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner._full_state(optimizer=False)[0].items()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=2e-6, msg=name)


def test_a_sharded_trainer_steps_checkpoints_and_resumes_like_an_unsharded_one(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    plain = Learner(LearnJob.of(_run(tiny_model, 1)), tmp_path / "plain")
    sharded = Learner(LearnJob.of(_run(tiny_model, 2)), tmp_path / "sharded")
    try:
        assert sharded.sharded is not None and sharded.sharded.world == 2
        initial = _weights(plain)
        _assert_close(_weights(sharded), initial)
        for step in range(2):
            samples = _samples(step, version=step)
            a, b = plain.step(samples), sharded.step(samples)
            assert b.data_parallel == 2 and b.tokens == a.tokens and b.updates == a.updates == 2
            assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
            assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
            assert b.ref_kl == pytest.approx(a.ref_kl, rel=1e-3, abs=1e-7)
            _assert_close(_weights(sharded), _weights(plain))  # the Adam state too: step 2 agrees
            plain.commit({s.trajectory_id for s in samples})
            path = sharded.commit({s.trajectory_id for s in samples})
        assert not torch.equal(
            _weights(sharded)["model.embed_tokens.weight"], initial["model.embed_tokens.weight"]
        )

        # the sharded trainer's checkpoint is an ordinary one: an unsharded trainer resumes from it
        # and its next step is the sharded trainer's next step
        resumed = Learner(LearnJob.of(_run(tiny_model, 1)), tmp_path / "sharded")
        assert resumed.resume() == path and resumed.state.step == 2 and resumed.state.version == 2
        samples = _samples(7, version=2)
        resumed.step(samples)
        sharded.step(samples)
        _assert_close(_weights(resumed), _weights(sharded))

        # ...and the other way round: the sharded trainer loads the unsharded trainer's checkpoint
        plain_path = plain.commit({"x"})
        assert sharded.rollback(2) == path  # back to its own committed step 2 first
        sharded.ckpt_dir = plain_path.parent
        assert sharded.resume() == plain_path and sharded.state.step == 3
        _assert_close(_weights(sharded), _weights(plain))

        # no checkpoint at all: the initial weights and a fresh optimizer
        sharded.ckpt_dir = tmp_path / "empty"
        assert sharded.rollback(0) is None and sharded.state.step == 0
        _assert_close(_weights(sharded), initial)

        # a push carries what an unsharded trainer's push carries, bit for bit; the export loads
        snap, fresh = (
            sharded.snapshot(),
            Learner(LearnJob.of(_run(tiny_model, 1)), tmp_path / "fresh").snapshot(),
        )
        assert set(snap.names) ^ set(fresh.names) == set(), set(snap.names) ^ set(fresh.names)
        assert (snap.version, snap.names, snap.checksum) == (fresh.version, fresh.names, fresh.checksum)
        saved = sharded.save_policy("fsdp-test")
        import transformers

        exported = transformers.AutoModelForCausalLM.from_pretrained(str(saved)).state_dict()
        _assert_close({k: exported[k] for k in initial}, initial)
    finally:
        sharded.close()
    assert all(not p.is_alive() for p in sharded.sharded.procs)  # the other rank stopped with it


def test_a_push_snapshot_during_a_step_waits_for_it(tiny_model: ModelConfig, tmp_path: Path) -> None:
    """The trainer's threads call the sharded trainer at once (a push's snapshot or a policy save
    while a step runs): each operation runs whole on every rank, one after the other. Interleaved,
    the ranks ran different collectives and rank 1 died mid-job (`Connection reset by peer`)."""
    from concurrent.futures import ThreadPoolExecutor

    plain = Learner(LearnJob.of(_run(tiny_model, 1)), tmp_path / "plain")
    sharded = Learner(LearnJob.of(_run(tiny_model, 2)), tmp_path / "sharded")
    try:
        initial = _weights(plain)
        samples = _samples(3)
        with ThreadPoolExecutor(3) as pool:
            stepped = pool.submit(sharded.step, samples)
            seen = [pool.submit(_weights, sharded) for _ in range(4)] + [pool.submit(sharded.snapshot)]
            assert stepped.result(timeout=300).data_parallel == 2
            for future in seen[:-1]:  # whole weights, from before the step or after it
                state = future.result(timeout=300)
                assert state.keys() == initial.keys()
            assert seen[-1].result(timeout=300).version == 0
        plain.step(samples)
        _assert_close(_weights(sharded), _weights(plain))
    finally:
        sharded.close()
    assert all(not p.is_alive() for p in sharded.sharded.procs)


def test_a_dead_rank_is_reported_not_waited_for(tiny_model: ModelConfig, tmp_path: Path) -> None:
    from services.learning.fsdp import ShardFailure

    sharded = Learner(LearnJob.of(_run(tiny_model, 2)), tmp_path / "ckpt")
    try:
        assert sharded.sharded is not None
        (rank1,) = sharded.sharded.procs
        rank1.kill()
        rank1.join()
        with pytest.raises(ShardFailure, match="libra-fsdp-rank1"):
            sharded.step(_samples(0))
    finally:
        sharded.close()


def test_fsdp_refuses_hybrid_workers() -> None:
    with pytest.raises(ValueError, match="hybrid workers cannot join a sharded step"):
        RunConfig.model_validate({"training": {"fsdp": 2}, "planner": {"hybrid": {"workers": 1}}})
