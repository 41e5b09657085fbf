"""What `libra run` hears of a running job: the services' heartbeats, the trainer's step metrics and
weight pushes, the engines' load and the scheduler's stats, kept as the job's timeline
(runs/<id>/timeline.json, drawn by tools/run_plots.py) and its progress."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import control, subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from tools.loggers import StepLoggers
from tools.run_plots import write_run_plots
from tools.samples import SampleStore

PLOT_REFRESH_S = 60.0  # plots of a running job are redrawn this often
MAX_TIMELINE = 200_000  # samples kept per series (about two days at one a second)


@dataclass
class Progress:
    committed_step: int = 0
    committed_version: int = 0
    checkpoint: str = ""
    trained_twice: int = 0
    completed: int = 0
    in_flight: int = 0
    last_change: float = field(default_factory=time.monotonic)

    def update(self, committed: ev.TrainerFacts | None, stats: ev.SchedulerStats | None) -> None:
        """`committed`: the trainer's facts (None: unreadable now, the progress stays as it was)."""
        if committed is not None:
            if committed.step != self.committed_step:
                self.last_change = time.monotonic()
            self.committed_step, self.committed_version = committed.step, committed.version
            self.checkpoint, self.trained_twice = committed.checkpoint, committed.trained_twice
        done = stats.trajectories_completed if stats is not None else self.completed
        if done != self.completed:
            self.last_change = time.monotonic()
        self.completed = done
        if stats is not None:
            self.in_flight = stats.trajectories_in_flight


class SpecTotals:
    """Speculative decoding over every engine of a job: each engine's load report carries its
    counters since it started; one that restarted (its counters fell) adds to what it had."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int, int]] = {}
        self.base: dict[str, tuple[int, int, int]] = {}

    def update(self, load: ev.EngineLoad) -> None:
        now = (load.spec_verify_steps, load.spec_drafted_tokens, load.spec_accepted_tokens)
        before = self.last.get(load.engine_id, (0, 0, 0))
        if now < before:  # a restarted engine counts from zero again
            base = self.base.get(load.engine_id, (0, 0, 0))
            self.base[load.engine_id] = (base[0] + before[0], base[1] + before[1], base[2] + before[2])
        self.last[load.engine_id] = now

    def totals(self) -> list[int]:
        """[verify steps, drafted tokens, accepted tokens] over every engine so far."""
        out = [0, 0, 0]
        for engine, now in self.last.items():
            base = self.base.get(engine, (0, 0, 0))
            for i in range(3):
                out[i] += now[i] + base[i]
        return out


def speculation_report(totals: list[int], marks: list[list[int]]) -> dict[str, Any]:
    """Acceptance over the job and per step, from the totals at each step's end (`marks`)."""

    def rates(steps: int, drafted: int, accepted: int) -> dict[str, float | None]:
        return {
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted": round(accepted / steps, 3) if steps else None,
        }

    per_step, prev = [], [0, 0, 0]
    for mark in marks:
        delta = [a - b for a, b in zip(mark, prev, strict=True)]
        per_step.append(rates(*delta))
        prev = mark
    steps, drafted, accepted = totals
    return {
        "verify_steps": steps,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        **rates(steps, drafted, accepted),
        "acceptance_rate_per_step": [s["acceptance_rate"] for s in per_step],
        "mean_accepted_per_step": [s["mean_accepted"] for s in per_step],
    }


class JobObserver:
    def __init__(self, run_id: str, loggers: StepLoggers, out_dir: Path | None):
        self.run_id, self.loggers, self.out_dir = run_id, loggers, out_dir
        self.targets: Collection[str] = ()
        """The job's services (heartbeats and loads of others are not this job's)."""
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.engine_loads: list[dict[str, Any]] = []
        self.step_marks: dict[int, dict[str, Any]] = {}
        self._plotted = time.monotonic()
        self.metrics: list[ev.TrainMetrics] = []
        self.pushes: list[ev.WeightsUpdated] = []
        self.statuses: dict[str, ev.WorkerStatus] = {}
        self.seen: dict[str, float] = {}
        self.progress = Progress()
        self.stats: ev.SchedulerStats | None = None
        self.spec = SpecTotals()
        """Speculative decoding over the job's engines (their load reports' counters)."""
        self.sample_store = SampleStore()
        """The job's trajectories as text and its groups' outcomes, for runs/<id>/samples.jsonl."""
        self.worker_values: dict[str, dict[str, float]] = {}
        """Each of the job's workers' last metric sample (an engine's prefix-cache hit rate, ...)."""

    async def subscribe(self, bus: Bus) -> None:
        await bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, self._on_metrics)
        await bus.subscribe(subjects.WEIGHTS_UPDATED, ev.WeightsUpdated, self._on_weights)
        await bus.subscribe(subjects.ENGINE_LOAD, ev.EngineLoad, self._on_load)
        await bus.subscribe(subjects.METRICS, ev.MetricSample, self._on_sample)
        await bus.subscribe(subjects.TRAJ_SAMPLE, ev.TrajectorySample, self._on_traj_sample)
        await bus.subscribe(subjects.GROUP_OUTCOME, ev.GroupOutcome, self._on_outcome)

    async def _on_traj_sample(self, s: ev.TrajectorySample, _: Envelope) -> None:
        self.sample_store.add(s)

    async def _on_outcome(self, o: ev.GroupOutcome, _: Envelope) -> None:
        self.sample_store.outcome(o)

    async def _on_sample(self, m: ev.MetricSample, _: Envelope) -> None:
        if m.worker_id in self.targets:
            self.worker_values[m.worker_id] = dict(m.values)

    async def on_heartbeat(self, raw: Any) -> None:
        """A worker's heartbeat, from that worker only (control.heard)."""
        st = control.heard(raw, ev.WorkerStatus)
        if st is not None and st.worker_id in self.targets:
            self.statuses[st.worker_id] = st
            self.seen[st.worker_id] = time.monotonic()

    async def _on_metrics(self, m: ev.TrainMetrics, _: Envelope) -> None:
        self.metrics.append(m)
        if self.loggers.active:
            await asyncio.to_thread(self.loggers.step, m)  # a remote MLflow must not stall the loop
        if m.step > 0:
            self.step_marks[m.step] = {
                "t": round(time.monotonic() - self.t0, 2),
                "step": m.step,
                "step_s": round(m.step_s, 3),
                "push_s": round(m.push_s, 3),
                "spec": self.spec.totals(),
            }

    async def _on_load(self, load: ev.EngineLoad, _: Envelope) -> None:
        if load.engine_id in self.targets:
            self.spec.update(load)
        if load.engine_id in self.targets and len(self.engine_loads) < MAX_TIMELINE:
            self.engine_loads.append(
                {
                    "t": round(time.monotonic() - self.t0, 2),
                    "engine": load.engine_id,
                    "running": load.running,
                    "waiting": load.waiting,
                    "capacity": load.capacity_seqs,
                    "tokens_per_s": round(load.tokens_per_s, 2),
                }
            )

    def timeline(self) -> dict[str, Any]:
        """What the run did over time (runs/<id>/timeline.json, drawn by tools/run_plots.py)."""
        steps = [self.step_marks[k] for k in sorted(self.step_marks)]
        return {"samples": self.samples, "engines": self.engine_loads, "steps": steps}

    async def refresh_plots(self) -> None:
        if self.out_dir is None or time.monotonic() - self._plotted < PLOT_REFRESH_S:
            return
        self._plotted = time.monotonic()
        with contextlib.suppress(Exception):  # a plot never costs the job
            await asyncio.to_thread(write_run_plots, self.timeline(), self.run_id, self.out_dir)

    async def _on_weights(self, w: ev.WeightsUpdated, _: Envelope) -> None:
        self.pushes.append(w)

    async def poll(self, bus: Bus, committed: Callable[[], Awaitable[ev.TrainerFacts | None]]) -> None:
        """The scheduler's stats and the trainer's committed step, now."""
        stats = None
        with contextlib.suppress(Exception):
            stats = await bus.request(
                subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, timeout=2
            )
        if stats is not None:
            self.stats = stats
            if len(self.samples) < MAX_TIMELINE:
                self.samples.append(
                    {
                        "t": round(time.monotonic() - self.t0, 2),
                        "completed": stats.trajectories_completed,
                        "in_flight": stats.trajectories_in_flight,
                        "failed": stats.trajectories_failed,
                        "turns": stats.turns,
                        "tool_calls": dict(stats.tool_calls_by_status),
                    }
                )
        self.progress.update(await committed(), stats)
