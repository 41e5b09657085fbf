"""What one simulation is and how it runs: the named scenarios, a job (a system at pinned settings
on one seed) and the runner that builds its environment once per process and runs jobs over a
small process pool."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.common.cost_model import load_presets, load_profile
from services.common.synthetic import Workload
from services.policy.search import Plan
from services.simulation.runner import run_system
from services.simulation.state import SystemConfig
from tools.sim.systems import (
    PLAN_SEED,
    SYSTEMS,
    Env,
    baseline_system,
    libra_colocated,
    libra_system,
    speculation_for,
)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    gpu: str
    model: str
    workload: str
    n_gpus: int
    steps: int
    systems: tuple[str, ...]
    seeds: int = 5
    sweep_steps: int = 8
    """Steps each what-if (baseline sweeps, planner proposals) runs; 0 = analytical planning only."""
    prompts_per_step: int | None = None
    """Override the workload file's prompts per RL step (GRPO groups per batch)."""
    staleness: int = 1
    tick_s: float = 2.0
    plan_slice_gpus: int = 0
    """Choose settings on a slice of this many GPUs at the same per-GPU load (prompts scaled down),
    with `slice_sweep_steps`, then scale the allocation up: the 48-GPU planning, at any size."""
    slice_sweep_steps: int = 6
    acceptance_scale: float = 1.0
    """Multiplier on every drafter's extra accepted tokens per step (sensitivity)."""
    calibration: tuple[tuple[str, Any], ...] = ()
    """Cost-model constants overridden for this run (`Calibration` field, value): sensitivity."""
    profile: str | None = None
    """A `libra calibrate` profile: its measured machine and model replace the `gpu` and `model`
    presets, its fitted constants the assumed ones."""


SCENARIOS = {
    "paper-48gpu": Scenario("paper-48gpu", "A800", "qwen3-14b", "r2e_gym", 48, 20, SYSTEMS),
    "scale-1024": Scenario(
        "scale-1024",
        "A800",
        "qwen3-14b",
        "r2e_gym",
        1024,
        6,
        ("libra",),
        seeds=1,
        sweep_steps=0,
        prompts_per_step=683,
        tick_s=10.0,
        plan_slice_gpus=48,
    ),
}


@dataclass(frozen=True, slots=True)
class Job:
    """One simulation: a system at pinned settings on one seed."""

    name: str
    settings: dict[str, Any]
    seed: int
    steps: int
    timeline: bool = False


class Runner:
    """Builds environments once per process and runs jobs, in parallel when `jobs` > 1."""

    def __init__(self, scenario: Scenario, workload: Workload | None, jobs: int = 1) -> None:
        self.scenario = scenario
        self.cm = (
            load_profile(scenario.profile) if scenario.profile else load_presets(scenario.gpu, scenario.model)
        )
        wl = workload or Workload.load(scenario.workload)
        over = {"prompts_per_step": scenario.prompts_per_step} if scenario.prompts_per_step else {}
        self.workload = wl.with_overrides(self.cm.model.max_context, **over)
        if scenario.calibration:
            consts: dict[str, Any] = dict(scenario.calibration)
            self.cm.calib = dataclasses.replace(self.cm.calib, **consts)
        self.env = Env(
            self.cm,
            self.workload,
            scenario.n_gpus,
            PLAN_SEED,
            scenario.staleness,
            acceptance_scale=scenario.acceptance_scale,
        )
        self.jobs = max(1, jobs)

    def env_for(self, seed: int, max_seqs: int | None = None) -> Env:
        return dataclasses.replace(self.env, seed=seed, max_seqs=max_seqs or self.env.max_seqs)

    def build(self, job: Job) -> SystemConfig:
        s = job.settings
        env = self.env_for(job.seed, s.get("max_seqs"))
        drafter, spec = speculation_for(s)
        if "colocated_tp" in s:
            return libra_colocated(
                env,
                job.name,
                int(s["colocated_tp"]),
                s.get("routing", "cmlfq"),
                drafter,
                spec,
                float(s.get("partial", 0.0)),
            )
        if "plan" in s:
            return libra_system(
                env,
                job.name,
                Plan.from_dict(s["plan"]),
                s.get("routing", "cmlfq"),
                s.get("replan", True),
                int(s.get("lend_tp", 0)),
                drafter,
                spec,
                bool(s.get("kv_migration", False)),
                bool(s.get("relayout", False)),
            )
        return baseline_system(
            env,
            job.name,
            int(s.get("split", 0)),
            int(s.get("tp", 1)),
            tuple(s.get("mix", ())),
            drafter,
            spec,
            float(s.get("partial", 0.0)),
        )

    def run_one(self, job: Job) -> dict[str, Any]:
        system = self.build(job)
        r, sim = run_system(
            system, self.workload, self.cm, self.scenario.n_gpus, job.steps, job.seed, self.scenario.tick_s
        )
        if job.timeline:
            r["timeline"] = sim.timeline
        r["max_staleness_trained"] = max(sim.trained_oldest_staleness, default=0)
        return r

    def run_all(self, jobs: Sequence[Job], tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        if not jobs:
            return []
        if self.jobs == 1 or len(jobs) == 1:
            out = []
            for j in jobs:
                out.append(self.run_one(j))
                if tick:
                    tick()
            return out
        global _RUNNER
        _RUNNER = self
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(self.jobs, len(jobs)), mp_context=ctx) as pool:
            futures = [pool.submit(_run_in_child, j) for j in jobs]
            results = []
            for f in futures:
                results.append(f.result())
                if tick:
                    tick()
        return results


_RUNNER: Runner | None = None


def _run_in_child(job: Job) -> dict[str, Any]:
    assert _RUNNER is not None
    return _RUNNER.run_one(job)


def default_jobs() -> int:
    return max(1, min(2, len(os.sched_getaffinity(0))))
