"""The workload a live job has shown so far, as the simulator draws it: what the planner simulates
its candidate layouts on.

The scheduler reports a sample of recent trajectories' output lengths (the running ones counted as
censored: `services/policy/replan.py`, `length_sample`), the mean turns per trajectory, the mean
seconds per tool call and the mean prompt. A drawn trajectory takes its total output from that
sample (a bootstrap draw: the tail the buckets exist for is the measured one), its turns from a
geometric law with the measured mean, its tool latencies from an exponential law with the measured
mean, and tool returns that bring its final context to `context_per_output` times its output. The
two laws are assumptions: the scheduler reports means, not distributions, of turns and tool time.
Samples of a group are drawn independently (the measured sample does not say how they correlate).
"""

from __future__ import annotations

import random
from typing import Any

from services.common.signals import ToolSignal, size_class
from services.common.synthetic import ToolCall, TrajectorySpec, Turn
from services.policy.search import WorkloadStats

MAX_TURNS = 64
"""Turns a drawn trajectory has at most (the geometric law's far tail cut off)."""


class ObservedWorkload:
    name = "observed"

    def __init__(self, stats: WorkloadStats, group_size: int, prompts_per_step: int, max_context: int = 0):
        if not stats.output_tokens:
            raise ValueError("an observed workload needs at least one trajectory's output length")
        self.stats = stats
        self.group_size = group_size
        self.prompts_per_step = prompts_per_step
        self.max_context = max_context if max_context > 0 else 1 << 62
        self.max_turns = MAX_TURNS
        self._lengths = [max(1, int(x)) for x in stats.output_tokens]

    def with_overrides(self, max_context: int = 0, **fields: Any) -> ObservedWorkload:
        unknown = set(fields) - {"group_size", "prompts_per_step"}
        if unknown:
            raise ValueError(f"an observed workload takes no {sorted(unknown)}")
        return ObservedWorkload(
            self.stats,
            int(fields.get("group_size", self.group_size)),
            int(fields.get("prompts_per_step", self.prompts_per_step)),
            max_context or (self.max_context if self.max_context < 1 << 62 else 0),
        )

    def group_for(self, seed: int, index: int, step: int, prompt_id: str) -> list[TrajectorySpec]:
        """The `index`-th group of a run with `seed`: the same draw whatever the timing, so
        candidates simulated on one seed see the same trajectories (common random numbers)."""
        return self.sample_group(random.Random(f"{seed}:{index}"), prompt_id, step)

    def sample_group(self, rng: random.Random, prompt_id: str, step: int) -> list[TrajectorySpec]:
        prompt = max(1, min(int(self.stats.prompt_tokens), self.max_context // 2))
        return [self._sample(rng, prompt_id, prompt) for _ in range(self.group_size)]

    def _sample(self, rng: random.Random, prompt_id: str, prompt: int) -> TrajectorySpec:
        s = self.stats
        total = self._lengths[rng.randrange(len(self._lengths))]
        stop = 1.0 / max(1.0, s.mean_turns)
        n = 1
        while n < min(total, MAX_TURNS) and rng.random() >= stop:
            n += 1
        weights = [rng.expovariate(1.0) for _ in range(n)]
        scale = total / sum(weights)
        outs = [max(1, int(w * scale)) for w in weights]
        outs[-1] = max(1, total - sum(outs[:-1]))
        payload = max(1, int((s.context_per_output - 1.0) * total / max(1, n - 1)))
        signal = ToolSignal("observed", size_class(payload), "success")
        turns: list[Turn] = []
        context = prompt
        for i, out in enumerate(outs):
            out = max(1, min(out, self.max_context - 1 - context))
            context += out
            if i == n - 1 or context + payload >= self.max_context - 1:
                turns.append(Turn(out, None))
                break
            latency = rng.expovariate(1.0 / s.mean_tool_s) if s.mean_tool_s > 0 else 0.0
            turns.append(Turn(out, ToolCall(signal, latency, payload)))
            context += payload
        return TrajectorySpec(prompt_id, prompt, tuple(turns))
