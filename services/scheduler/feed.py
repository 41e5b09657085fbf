"""The task feed: dataset → GRPO groups, released under a staleness budget, every group accounted for.

Asynchronous RL lets rollout run ahead of training, but a trajectory sampled by a policy more than
`max_staleness` versions old is useless to the trainer. The feed therefore releases a new group only
while the groups launched stay within (max_staleness + 1) training steps of what has been trained.

Every launched group is outstanding until the trainer reports its outcome. A group that was not
trained (stale, failed by the infrastructure) is replaced by a new one on the next prompt,
and does not count against the staleness budget: the job still trains `steps × groups_per_step`
groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.runconfig import (
    OWN_DATASETS,
    ReasoningGymDataset,
    TaskConfig,
    TrainingConfig,
    VerifiersDataset,
)
from services.policy.staleness import StalenessBound
from services.scheduler.datasets import file_tasks
from services.scheduler.task import Task, builtin_tasks, synthetic_tasks


@dataclass
class GroupTicket:
    group_id: str
    task: Task
    index: int

    def trajectory_id(self, sample: int) -> str:
        return f"{self.group_id}-s{sample}"


def group_of(trajectory_id: str) -> str:
    """The group of a trajectory id made by `GroupTicket.trajectory_id`."""
    return trajectory_id.rsplit("-s", 1)[0]


class TaskFeed:
    def __init__(self, tasks: list[Task], *, groups_per_step: int, max_staleness: int, total_steps: int):
        if not tasks:
            raise ValueError("the task feed needs at least one task")
        self.tasks = tasks
        self.groups_per_step = groups_per_step
        self.bound = StalenessBound(max_staleness)
        self.total_groups = groups_per_step * total_steps
        self.launched = 0
        self.replaced = 0
        self.outstanding: dict[str, GroupTicket] = {}
        self.outcomes: dict[str, int] = {}

    def budget(self, trained_version: int) -> int:
        """Groups that may be in flight or waiting for the trainer at policy version `trained_version`."""
        limit = self.bound.launch_limit(trained_version, self.groups_per_step, self.replaced)
        return max(0, min(limit, self.total_groups) - self.launched)

    def ticket(self, index: int) -> GroupTicket:
        """The group launched at position `index` (deterministic: the same index, the same group)."""
        task = self.tasks[index % len(self.tasks)]
        return GroupTicket(group_id=f"g{index:05d}-{task.prompt_id}", task=task, index=index)

    def restore(
        self,
        *,
        launched: int,
        replaced: int,
        total_groups: int,
        outstanding: list[int],
        outcomes: dict[str, int],
    ) -> list[GroupTicket]:
        """Continues from an earlier scheduler's cursor; returns the groups still outstanding."""
        self.launched, self.replaced, self.total_groups = launched, replaced, total_groups
        self.outcomes = dict(outcomes)
        self.outstanding = {t.group_id: t for t in (self.ticket(i) for i in sorted(outstanding))}
        return list(self.outstanding.values())

    def take(self, trained_version: int) -> list[GroupTicket]:
        out = []
        for _ in range(self.budget(trained_version)):
            ticket = self.ticket(self.launched)
            out.append(ticket)
            self.outstanding[ticket.group_id] = ticket
            self.launched += 1
        return out

    def resolve(self, group_id: str, outcome: str) -> bool:
        """Records the trainer's outcome for a launched group; True when the group is replaced.

        Outcomes for groups this feed did not launch, or already resolved, change nothing.
        """
        if self.outstanding.pop(group_id, None) is None:
            return False
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "trained":
            return False
        self.replaced += 1
        self.total_groups += 1
        return True

    @property
    def exhausted(self) -> bool:
        return self.launched >= self.total_groups


def task_list(task: TaskConfig) -> list[Task]:
    """Every task of the run, in feed order: generated, or read (and checked) from the dataset file."""
    limit = task.num_prompts if "num_prompts" in task.model_fields_set else None
    if isinstance(task.dataset, OWN_DATASETS):
        return file_tasks(task.dataset, limit)
    if isinstance(task.dataset, ReasoningGymDataset):
        from services.scheduler.gym_tasks import gym_tasks

        return gym_tasks(task.dataset)[:limit]
    if isinstance(task.dataset, VerifiersDataset):
        from services.scheduler.verifiers_env import verifiers_tasks

        return verifiers_tasks(task.dataset, task.max_turns, task.plugin_paths)[:limit]
    if task.dataset == "synthetic":
        return synthetic_tasks(task.num_prompts)
    return builtin_tasks(task.dataset, task.num_prompts, task.seed)


def build_feed(task: TaskConfig, training: TrainingConfig) -> TaskFeed:
    """The feed of a job's task: what the scheduler releases, group by group, as fast as
    `training`'s steps and staleness bound allow."""
    return TaskFeed(
        task_list(task),
        groups_per_step=training.groups_per_step,
        max_staleness=training.max_staleness,
        total_steps=training.steps,
    )
