"""Least-loaded routing of a turn to a rollout engine (C-MLFQ replaces this in its own issue)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineView:
    engine_id: str
    bucket: str
    in_flight: int = 0
    reported_waiting: int = 0
    healthy: bool = True

    @property
    def load(self) -> int:
        return self.in_flight + self.reported_waiting


def pick_least_loaded(engines: list[EngineView], bucket: str | None = None) -> EngineView | None:
    """The healthy engine with the fewest outstanding requests, preferring the bucket if it has any."""
    healthy = [e for e in engines if e.healthy]
    in_bucket = [e for e in healthy if bucket is None or e.bucket == bucket]
    candidates = in_bucket or healthy
    if not candidates:
        return None
    return min(candidates, key=lambda e: (e.load, e.engine_id))
