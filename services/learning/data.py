"""Completed trajectories to training tensors.

A trajectory is its segments in order: the prompt, then generated turns and tool returns. The model
sees their concatenation; only generated tokens carry loss. A trajectory whose agent rewrote its
conversation is several sequences, each beginning at a segment that `starts_sequence` (the
rewritten conversation as the model saw it): each is trained as one sample, with the trajectory's
reward, and the group's advantages count the trajectory once. Everything is kept shifted by one, the
way the logits are used: column j of the mask, the behaviour logprobs, the temperatures and the
versions describes token j+1, which the logits at position j predict (see `grpo.token_logprobs`). torch is imported only when collating, so
the service shell can validate trajectories without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.contracts import MAX_TEMPERATURE, ev
from services.common.errors import require

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sample:
    """One sequence of a trajectory (most trajectories are one), flattened per position: token, loss flag, the engine's (behaviour) logprob,
    the temperature it was computed at and the weight version that sampled the token (0.0, 1.0 and
    -1 where there is no loss)."""

    trajectory_id: str
    group_id: str
    reward: float
    input_ids: list[int]
    loss_mask: list[bool]
    behaviour_logprobs: list[float]
    temperatures: list[float] | None = None
    """None: 1.0 everywhere."""
    versions: list[int] | None = None
    """None: -1 everywhere (unknown: never counted as sampled by the step's weights)."""
    truncated: bool = False
    """It ran out of room (CompletedTrajectory.truncated): task.overlong.filter masks its tokens."""

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded tensors: input_ids/attention_mask [B, T]; loss_mask, behaviour_logprobs,
    temperatures, versions [B, T-1]; advantages [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    temperatures: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_sequences(self) -> int:
        """Rows with a generated token (the sequences a `seq_mean_*` loss averages over)."""
        return int((self.loss_mask.sum(-1) > 0).sum().item())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same batch on `device` (itself when it is there already)."""
        import torch

        if self.input_ids.device == torch.device(device):
            return self
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return MicroBatch(*(t.to(device, non_blocking=True) for t in fields))


def validate(
    traj: ev.CompletedTrajectory, vocab_size: int | None = None, newest_version: int | None = None
) -> None:
    """Raises InvalidMessage when a trajectory cannot be trained on as sent: also when its
    tokens claim a policy version newer than `newest_version` (the trainer's own)."""
    require(bool(traj.trajectory_id), "trajectory_id is empty")
    require(bool(traj.group_id), "group_id is empty")
    require(traj.group_size >= 2, f"group_size must be >= 2, got {traj.group_size}")
    require(0 <= traj.sample_index < traj.group_size, f"sample_index {traj.sample_index} out of range")
    require(len(traj.segments) > 0, "no segments")
    require(math.isfinite(traj.reward), "reward is not finite")
    require(not traj.segments[0].generated, "the first segment must be the prompt (generated=false)")
    generated = 0
    for i, seg in enumerate(traj.segments):
        require(
            not (seg.generated and seg.starts_sequence),
            f"segment {i}: a sequence starts with a prompt (generated=false), not generated tokens",
        )
        if seg.generated:
            require(
                len(seg.logprobs) == len(seg.token_ids),
                f"segment {i}: {len(seg.logprobs)} logprobs for {len(seg.token_ids)} generated tokens",
            )
            require(all(math.isfinite(x) and x <= 1e-4 for x in seg.logprobs), f"segment {i}: bad logprob")
            require(
                math.isfinite(seg.temperature) and 0.0 < seg.temperature <= MAX_TEMPERATURE,
                f"segment {i}: temperature {seg.temperature} is not in (0, {MAX_TEMPERATURE}]",
            )
            generated += len(seg.token_ids)
            if newest_version is not None:
                require(
                    seg.policy_version <= newest_version,
                    f"segment {i}: policy version {seg.policy_version} is newer than the trainer's {newest_version}",
                )
        if vocab_size is not None:
            require(all(0 <= t < vocab_size for t in seg.token_ids), f"segment {i}: token id outside vocab")
        else:
            require(all(t >= 0 for t in seg.token_ids), f"segment {i}: negative token id")
    require(generated > 0, "no generated tokens")


def to_samples(traj: ev.CompletedTrajectory) -> list[Sample]:
    """Its sequences as samples, in order; a sequence without generated tokens (its context ran
    out right after a rewrite) teaches nothing and is left out."""
    starts = [i for i, seg in enumerate(traj.segments) if i == 0 or seg.starts_sequence]
    bounds = zip(starts, [*starts[1:], len(traj.segments)], strict=True)
    samples = [_sample(traj, traj.segments[a:b]) for a, b in bounds]
    return [s for s in samples if s.num_generated]


def one_per_trajectory(samples: Sequence[Sample]) -> list[Sample]:
    """The first sample of each trajectory, in order: what a group's rewards and advantages count
    (a trajectory of several sequences is still one member of its group)."""
    seen: dict[str, Sample] = {}
    for s in samples:
        seen.setdefault(s.trajectory_id, s)
    return list(seen.values())


def _sample(traj: ev.CompletedTrajectory, segments: Sequence[ev.Segment]) -> Sample:
    ids: list[int] = []
    mask: list[bool] = []
    behaviour: list[float] = []
    temps: list[float] = []
    versions: list[int] = []
    for seg in segments:
        n = len(seg.token_ids)
        ids.extend(seg.token_ids)
        mask.extend([seg.generated] * n)
        behaviour.extend(seg.logprobs if seg.generated else [0.0] * n)
        temps.extend([seg.temperature if seg.generated else 1.0] * n)
        versions.extend([seg.policy_version if seg.generated else -1] * n)
    return Sample(
        traj.trajectory_id, traj.group_id, traj.reward, ids, mask, behaviour, temps, versions, traj.truncated
    )


def collate(samples: Sequence[Sample], advantages: Sequence[float], pad_id: int) -> MicroBatch:
    """Right-pads to the longest sample and shifts the per-token columns to the logits' positions."""
    import torch

    width = max(len(s.input_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    temps = torch.ones((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        behaviour[i, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if s.temperatures is not None:
            temps[i, :n] = torch.tensor(s.temperatures, dtype=torch.float32)
        if s.versions is not None:
            versions[i, :n] = torch.tensor(s.versions, dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask[:, 1:],
        behaviour_logprobs=behaviour[:, 1:],
        temperatures=temps[:, 1:],
        versions=versions[:, 1:],
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
    )


def micro_batches(
    samples: Sequence[Sample], advantages: Sequence[float], size: int, pad_id: int
) -> list[MicroBatch]:
    """Splits a step's samples into micro-batches of at most `size`, sorted by length to cut padding."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    out = []
    for k in range(0, len(order), size):
        idx = order[k : k + size]
        out.append(collate([samples[i] for i in idx], [advantages[i] for i in idx], pad_id))
    return out
