"""What the scheduler sees of the workload, over a sliding window: the planner's input for sizing
buckets and the rollout/training split. Pure: the caller passes `now`."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

from services.common.contracts import ev

LENGTH_SAMPLE = 512
"""Most recently launched trajectories whose output lengths travel in WorkloadStats (the planner's
sample): the final lengths of those that finished, the lengths so far of the others."""


def quantiles(values: Iterable[float]) -> ev.LengthQuantiles:
    """Nearest-rank quantiles (p50, p90, p99) and the maximum; all zero for no values."""
    xs = sorted(values)
    if not xs:
        return ev.LengthQuantiles()

    def rank(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 1)) - 1))]

    return ev.LengthQuantiles(count=len(xs), p50=rank(0.5), p90=rank(0.9), p99=rank(0.99), max=xs[-1])


class WorkloadWindow:
    def __init__(self, window_s: float = 60.0):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._turns: deque[tuple[float, int, int]] = deque()
        self._trajs: deque[tuple[float, int, float, int, int]] = deque()
        self._tools: deque[tuple[float, str, float]] = deque()
        self._cohort: OrderedDict[str, list[int]] = OrderedDict()
        """trajectory id -> [output tokens so far, 1 when finished], in launch order."""

    def launched(self, trajectory_id: str) -> None:
        self._cohort[trajectory_id] = [0, 0]
        if len(self._cohort) > LENGTH_SAMPLE:
            self._cohort.popitem(last=False)

    def turn(self, now: float, new_tokens: int, context_tokens: int, trajectory_id: str = "") -> None:
        self._turns.append((now, new_tokens, context_tokens))
        entry = self._cohort.get(trajectory_id)
        if entry is not None and not entry[1]:
            entry[0] += new_tokens

    def trajectory(
        self,
        now: float,
        turns: int,
        latency_s: float,
        output_tokens: int = 0,
        prompt_tokens: int = 0,
        trajectory_id: str = "",
    ) -> None:
        """A trajectory that finished; it is in the length sample if it was `launched` here (not
        by a scheduler before a restart) among the last LENGTH_SAMPLE."""
        self._trajs.append((now, turns, latency_s, output_tokens, prompt_tokens))
        if trajectory_id in self._cohort:
            self._cohort[trajectory_id] = [output_tokens, 1]

    def tool_return(self, now: float, status: str, seconds: float = 0.0) -> None:
        self._tools.append((now, status, seconds))

    def _trim(self, now: float) -> None:
        edge = now - self.window_s
        for q in (self._turns, self._trajs, self._tools):
            while q and q[0][0] < edge:
                q.popleft()

    def stats(self, now: float, queued_by_bucket: dict[str, int], trained_version: int) -> ev.WorkloadStats:
        self._trim(now)
        return ev.WorkloadStats(
            window_s=self.window_s,
            new_tokens_per_turn=quantiles(n for _, n, _ in self._turns),
            context_tokens_per_turn=quantiles(c for _, _, c in self._turns),
            turns_per_trajectory=quantiles(t[1] for t in self._trajs),
            trajectory_latency_s=quantiles(t[2] for t in self._trajs),
            queued_turns_by_bucket=queued_by_bucket,
            tool_returns_by_status=dict(Counter(s for _, s, _ in self._tools)),
            trajectories_per_s=len(self._trajs) / self.window_s,
            trained_version=trained_version,
            trajectory_output_tokens=[n for n, done in self._cohort.values() if done],
            running_output_tokens=[n for n, done in self._cohort.values() if not done],
            tool_s_per_turn=_mean(s for _, _, s in self._tools),
            prompt_tokens=_mean(t[4] for t in self._trajs),
            turns_per_trajectory_mean=_mean(t[1] for t in self._trajs),
        )


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs) if xs else 0.0
