"""When a job's own code (its `task.reward`, its `task.environment`) is broken rather than unlucky.

A reward or environment that raises fails only its trajectory, which is never trained on, and the
feed replaces its group. That is right for code that fails now and then; for code that fails on
(nearly) every call — a wrong signature, a missing key — it makes a job that replaces groups
forever while every failure looks like progress. This watches the trajectories that end, in order:
when at least `share` of the last `window` failed in the job's own code, the job is broken and
says why. Failures of the infrastructure (stale, an engine gone) count neither way. Pure: the
scheduler feeds it and ends the job.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

USER_CODE_PREFIXES = ("reward_", "env_", "agent_")
"""Failure codes that come from the job's own code (services/scheduler/plugins.py)."""


@dataclass
class BrokenUserCode:
    window: int = 20
    share: float = 0.9
    recent: deque[str] = field(default_factory=deque)
    """Of the last `window` trajectories that ended: '' (worked) or the user-code failure code."""
    last: dict[str, str] = field(default_factory=dict)
    """Failure code -> its latest message."""
    ended_total: int = 0
    failed_total: int = 0
    """Since the job started: trajectories that ended (infrastructure failures aside), and of them
    those that failed in the job's own code (the report counts every failure; this message says
    which ones it means)."""

    def ended(self, failure_code: str = "", message: str = "") -> str | None:
        """A trajectory ended (`failure_code` empty: it completed). Returns why the job's own code
        is broken, or None."""
        if failure_code and not failure_code.startswith(USER_CODE_PREFIXES):
            return None  # the infrastructure's failure says nothing about the job's code
        self.recent.append(failure_code)
        self.ended_total += 1
        self.failed_total += bool(failure_code)
        if len(self.recent) > self.window:
            self.recent.popleft()
        if failure_code:
            self.last[failure_code] = message
        failed = Counter(c for c in self.recent if c)
        if len(self.recent) < self.window or sum(failed.values()) < self.share * self.window:
            return None
        code, n = failed.most_common(1)[0]
        return (
            f"{sum(failed.values())} of the last {self.window} trajectories failed in the job's own "
            f"code ({n} with {code}; {self.failed_total} of {self.ended_total} since the job started, "
            f"not counting the infrastructure's failures); the latest: {self.last[code]}"
        )
