"""Trajectories to tensors: concatenation, loss mask on generated tokens, logprobs shifted to logits."""

from __future__ import annotations

import pytest
import torch

from services.common.contracts import ev
from services.common.errors import InvalidMessage
from services.learning.data import collate, micro_batches, one_per_trajectory, to_samples, validate


def to_sample(t: ev.CompletedTrajectory):
    (one,) = to_samples(t)
    return one


def traj(tid: str = "t0", **kw) -> ev.CompletedTrajectory:
    base = dict(
        trajectory_id=tid,
        group_id="g0",
        sample_index=0,
        group_size=2,
        reward=1.0,
        segments=[
            ev.Segment(token_ids=[10, 11, 12], generated=False),
            ev.Segment(
                token_ids=[20, 21], logprobs=[-0.5, -1.5], generated=True, policy_version=3, temperature=0.7
            ),
            ev.Segment(token_ids=[30], generated=False),
            ev.Segment(token_ids=[40], logprobs=[-2.0], generated=True, policy_version=4, temperature=1.3),
        ],
    )
    base.update(kw)
    return ev.CompletedTrajectory(**base)


def test_segments_concatenate_with_mask_and_logprobs() -> None:
    s = to_sample(traj())
    assert s.input_ids == [10, 11, 12, 20, 21, 30, 40]
    assert s.loss_mask == [False, False, False, True, True, False, True]
    assert s.behaviour_logprobs == [0.0, 0.0, 0.0, -0.5, -1.5, 0.0, -2.0]
    assert s.temperatures == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.7, 1.0, 1.3])
    assert s.versions == [-1, -1, -1, 3, 3, -1, 4]
    assert s.num_generated == 3


def test_collate_shifts_to_the_predicting_position_and_right_pads() -> None:
    short = to_sample(
        traj(
            "t1",
            segments=[
                ev.Segment(token_ids=[5], generated=False),
                ev.Segment(token_ids=[6], logprobs=[-0.25], generated=True, temperature=1.0),
            ],
        )
    )
    mb = collate([to_sample(traj()), short], [0.5, -0.5], pad_id=0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40], [5, 6, 0, 0, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    # column j describes token j+1, predicted by the logits at position j
    assert mb.loss_mask.tolist()[0] == [False, False, True, True, False, True]
    assert mb.behaviour_logprobs[0].tolist() == [0.0, 0.0, -0.5, -1.5, 0.0, -2.0]
    assert mb.temperatures[0].tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 1.0, 1.3])
    assert mb.versions[0].tolist() == [-1, -1, 3, 3, -1, 4]
    assert mb.loss_mask.tolist()[1] == [True, False, False, False, False, False]
    assert mb.behaviour_logprobs[1, 0].item() == pytest.approx(-0.25)
    assert mb.temperatures[1].tolist() == [1.0] * 6 and mb.versions[1, 1:].tolist() == [-1] * 5
    assert mb.num_tokens == 4
    assert torch.equal(mb.advantages, torch.tensor([0.5, -0.5]))


def test_micro_batches_keep_advantages_with_their_samples() -> None:
    samples = [to_sample(traj(f"t{i}")) for i in range(5)]
    batches = micro_batches(samples, [0.1, 0.2, 0.3, 0.4, 0.5], size=2, pad_id=0)
    assert [mb.input_ids.shape[0] for mb in batches] == [2, 2, 1]
    assert sorted(a for mb in batches for a in mb.advantages.tolist()) == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5]
    )


def rewritten(tid: str = "t0", reward: float = 1.0) -> ev.CompletedTrajectory:
    """An agent's trajectory that rewrote its conversation twice: the second time its context ran
    out before a token was generated."""
    return traj(
        tid,
        reward=reward,
        segments=[
            ev.Segment(token_ids=[10, 11], generated=False),
            ev.Segment(token_ids=[20], logprobs=[-0.5], generated=True, policy_version=3, temperature=1.0),
            ev.Segment(token_ids=[12, 13, 14], generated=False, starts_sequence=True),
            ev.Segment(
                token_ids=[21, 22], logprobs=[-1.0, -2.0], generated=True, policy_version=4, temperature=1.0
            ),
            ev.Segment(token_ids=[30], generated=False),
            ev.Segment(token_ids=[23], logprobs=[-3.0], generated=True, policy_version=4, temperature=1.0),
            ev.Segment(token_ids=[15, 16], generated=False, starts_sequence=True),
        ],
    )


def test_a_rewritten_conversation_is_trained_as_its_own_sequence() -> None:
    first, second = to_samples(rewritten())
    assert (first.input_ids, first.loss_mask) == ([10, 11, 20], [False, False, True])
    assert second.input_ids == [12, 13, 14, 21, 22, 30, 23]
    assert second.loss_mask == [False, False, False, True, True, False, True]
    assert second.behaviour_logprobs == [0.0, 0.0, 0.0, -1.0, -2.0, 0.0, -3.0]
    assert second.versions == [-1, -1, -1, 4, 4, -1, 4]
    assert {(s.trajectory_id, s.group_id, s.reward) for s in (first, second)} == {("t0", "g0", 1.0)}
    validate(rewritten(), vocab_size=100)
    # a group's member is its trajectory, whatever the number of its sequences
    samples = [*to_samples(rewritten()), *to_samples(traj("t1"))]
    assert [s.trajectory_id for s in one_per_trajectory(samples)] == ["t0", "t1"]


def test_valid_trajectory_passes() -> None:
    validate(traj(), vocab_size=100)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"trajectory_id": ""}, "trajectory_id"),
        ({"group_id": ""}, "group_id"),
        ({"group_size": 1}, "group_size"),
        ({"segments": []}, "no segments"),
        ({"segments": [ev.Segment(token_ids=[1], generated=False)]}, "no generated"),
        (
            {
                "segments": [
                    ev.Segment(token_ids=[1]),
                    ev.Segment(token_ids=[2, 3], logprobs=[-1.0], generated=True),
                ]
            },
            "logprobs",
        ),
        (
            {
                "segments": [
                    ev.Segment(token_ids=[1]),
                    ev.Segment(token_ids=[2], logprobs=[-1.0], generated=True, temperature=1.0),
                    ev.Segment(
                        token_ids=[3], logprobs=[-1.0], generated=True, temperature=1.0, starts_sequence=True
                    ),
                ]
            },
            "starts with a prompt",
        ),
        (
            {
                "segments": [
                    ev.Segment(token_ids=[1]),
                    ev.Segment(token_ids=[999], logprobs=[-1.0], generated=True, temperature=1.0),
                ]
            },
            "vocab",
        ),
        (
            {
                "segments": [
                    ev.Segment(token_ids=[1]),
                    ev.Segment(token_ids=[2], logprobs=[-1.0], generated=True),
                ]
            },
            "temperature",  # the engine always says which; 0 would be scored at the wrong one
        ),
        (
            {
                "segments": [
                    ev.Segment(token_ids=[1]),
                    ev.Segment(token_ids=[2], logprobs=[-1.0], generated=True, temperature=float("nan")),
                ]
            },
            "temperature",
        ),
    ],
)
def test_invalid_trajectories_are_refused(change: dict, reason: str) -> None:
    with pytest.raises(InvalidMessage, match=reason):
        validate(traj(**change), vocab_size=100)
