"""When the trainer lends its GPUs to rollout, and when it takes them back (planner.lending).

A forecast of the trainer's next batch from when recent groups became complete (the scheduler's
completion times, wherever the trainer learns of them late): the rate of the last few
completions, anchored at the last one. Each move of the GPUs costs `switch_s` one way, so
lending pays only if the batch is predicted to be further off than both moves plus some serving
time (`min_serve` switches), and the GPUs come back one switch before the batch is predicted to be
complete, so that the switch hides behind rollout rather than delaying the step — where that
pays: taking the GPUs back early costs rollout their share of its GPUs until the batch really
completes, and the forecast is often late for a batch's last, slowest group, so the policy
remembers how late recent batches came and reclaims early only if the hidden switch outweighs
that share of one switch plus the usual lateness.

Pure: time is passed in. The trainer service (`services.trainer.lending`) and the simulator
(`services.simulation.training`) both drive it, so what the simulator predicts is what the services do.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

POLICIES = ("predictive", "always")
"""`predictive`: this forecast decides; `always`: lend whenever no batch is complete, take the GPUs
back when one is (the switch then delays the step)."""


@dataclass(slots=True)
class LendPolicy:
    switch_s: float
    """One move of the training GPUs, either way (seconds in the caller's clock)."""
    mode: str = "always"
    window: int = 8
    """Completions the rate comes from."""
    min_serve: float = 1.0
    """Lend only if the lent engines are predicted to serve at least this many switches' time."""
    lent_share: float = 0.0
    """The lent GPUs' share of the GPUs serving rollout while they are lent: what taking them back
    early costs rollout."""
    _times: list[float] = field(init=False, default_factory=list)
    """The latest `window` completion times, in order."""
    _forecast: float | None = field(init=False, default=None)
    """When the batch being waited for was last forecast complete (while the GPUs were lent)."""
    _late: list[float] = field(init=False, default_factory=list)
    """How late the latest `window` batches completed after their last forecast (s, >= 0)."""

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"lending policy must be one of {', '.join(POLICIES)}, not {self.mode!r}")

    def completed(self, at: float) -> None:
        """A group became complete at `at` (heard of now or later: a trainer that was training
        learns of the groups completed meanwhile after its step)."""
        bisect.insort(self._times, at)
        del self._times[: max(0, len(self._times) - max(2, self.window))]

    def batch_complete(self) -> None:
        """The batch waited for is complete (at the latest completion heard of): how late that
        was against its last forecast, if one was made, is remembered."""
        if self._forecast is not None and self._times:
            self._late.append(max(0.0, self._times[-1] - self._forecast))
            del self._late[: max(0, len(self._late) - self.window)]
        self._forecast = None

    def lateness(self) -> float:
        """Mean seconds recent batches completed after their forecast (0 before any)."""
        return sum(self._late) / len(self._late) if self._late else 0.0

    def early_pays(self) -> bool:
        """Does taking the GPUs back one switch ahead of the forecast pay? It hides one switch from
        the step, and costs rollout the lent share of its GPUs from then until the batch really
        completes: one switch plus the forecast's usual lateness."""
        return self.switch_s > self.lent_share * (self.switch_s + self.lateness())

    def rate(self) -> float | None:
        """Groups completed per second over the window (None: fewer than two completions known,
        or all at one instant)."""
        if len(self._times) < 2 or self._times[-1] <= self._times[0]:
            return None
        return (len(self._times) - 1) / (self._times[-1] - self._times[0])

    def eta(self, now: float, ready: int, need: int) -> float | None:
        """Seconds until `need` groups are complete (None: nothing to forecast from). The next
        completion is due one interval after the last; once that is past, it is taken as due now."""
        if ready >= need:
            return 0.0
        rate = self.rate()
        if rate is None:
            return None
        since = max(0.0, now - self._times[-1])  # (another host's clock may run a little ahead)
        return max(0.0, (need - ready) / rate - min(since, 1 / rate))

    def should_lend(self, now: float, ready: int, need: int) -> bool:
        """The trainer waits for its batch: lend its GPUs now? (Unknown: yes, nothing to train.)"""
        if ready >= need:
            return False
        if self.mode == "always" or self.switch_s <= 0:
            return True
        eta = self.eta(now, ready, need)
        return eta is None or eta >= (2 + self.min_serve) * self.switch_s

    def reclaim_at(self, now: float, ready: int, need: int) -> float | None:
        """When to take the GPUs back if no further group completes first (None: not before one
        does): when the batch is complete, or one switch before its forecast."""
        if ready >= need:
            return now
        rate = self.rate()
        if self.mode == "always" or rate is None:
            return None
        last = self._times[-1]
        self._forecast = last + (need - ready) / rate
        at = self._forecast - self.switch_s
        if at - last > 1 / rate:  # the forecast only holds while the next completion is not overdue
            return None
        if not self.early_pays():  # the GPUs come back when the batch is complete
            return None
        return max(now, at)

    def should_reclaim(self, now: float, ready: int, need: int) -> bool:
        at = self.reclaim_at(now, ready, need)
        return at is not None and at <= now
