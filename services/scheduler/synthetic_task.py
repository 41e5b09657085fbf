"""The synthetic task: a simulator workload (`services/common/workloads/`) on the live stack.

Each GRPO group draws its trajectories from the workload exactly as the simulator does (a shared
difficulty, lognormal turn lengths, tool kinds, latencies, outcomes and payload size classes,
drift by RL step), deterministically from the run's seed and the group id, so a restarted
scheduler re-issues the same trajectories. A trajectory then follows that script: every turn asks
the engine for exactly its drawn length (min = max new tokens), every tool call goes to the
sandbox's `synthetic` tool with its drawn latency (times `rollout.emulated.time_scale`), outcome
and size class, and the tool's return adds the workload's token count for the size class the
sandbox reports. Prompt and observation tokens are filler: nothing is learned from this task.
"""

from __future__ import annotations

import random

from services.common.runconfig import TaskConfig
from services.common.synthetic import TrajectorySpec, Workload
from services.scheduler.agent import ToolRequest
from services.scheduler.feed import GroupTicket
from services.scheduler.trajectory import ScriptedTurn

FILLER = tuple(range(1000, 1064))
"""Token ids used for prompts and observations (valid in every vocabulary we ship)."""


class SyntheticTask:
    def __init__(self, task: TaskConfig, time_scale: float):
        """`time_scale`: the emulated engines' (rollout.emulated.time_scale): tool waits scale with it."""
        assert task.workload is not None, "validated by TaskConfig"
        self.task = task
        self.workload = Workload.load(task.workload).with_overrides(
            max_context=task.max_context_tokens, group_size=task.group_size
        )
        self.time_scale = time_scale
        self.payload_tokens = {k: int(v) for k, v in self.workload.spec["payload_tokens"].items()}

    def group(self, ticket: GroupTicket, version: int) -> list[TrajectorySpec]:
        """The group launched at `ticket.index` when the trainer was at `version`: the simulator's
        draw for the same seed and admission index."""
        return self.workload.group_for(self.task.seed, ticket.index, version, ticket.task.prompt_id)

    def script(self, spec: TrajectorySpec) -> list[ScriptedTurn]:
        out = []
        for turn in spec.turns:
            request = None
            if turn.tool is not None:
                sig = turn.tool.signal
                args = {"seconds": round(turn.tool.latency_s * self.time_scale, 4), "size": sig.size}
                request = ToolRequest("synthetic", {**args, "status": sig.status})
            out.append(ScriptedTurn(turn.output_tokens, request))
        return out

    @staticmethod
    def filler(n: int) -> list[int]:
        return [FILLER[i % len(FILLER)] for i in range(n)]

    def prompt_ids(self, spec: TrajectorySpec) -> list[int]:
        """Tokens of the prompt, the same for every sample of a group and different between
        prompts (so a prefix cache shares what real prompts would share, and no more)."""
        rng = random.Random(f"prompt:{spec.prompt_id}")
        return [rng.randrange(FILLER[0], 30_000) for _ in range(spec.prompt_tokens)]

    def observation_ids(self, size_class: str) -> list[int]:
        return self.filler(self.payload_tokens.get(size_class, self.payload_tokens["small"]))
