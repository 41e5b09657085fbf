"""Named scenarios and the baseline sweeps that give each baseline its best settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.sim.runner import load_presets, run_system
from tools.sim.systems import SYSTEMS, Env, build, default_splits
from tools.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    gpu: str
    model: str
    workload: str
    n_gpus: int
    steps: int
    systems: tuple[str, ...]
    sweep_steps: int = 4
    """Steps each simulated what-if (baseline sweeps, planner proposals) runs; 0 = analytical only."""
    prompts_per_step: int | None = None
    """Override the workload file's prompts per RL step (GRPO groups per batch)."""
    tick_s: float = 2.0


SCENARIOS = {
    "paper-48gpu": Scenario("paper-48gpu", "A800", "qwen3-14b", "r2e_gym", 48, 10, SYSTEMS),
    "scale-1024": Scenario(
        "scale-1024",
        "A800",
        "qwen3-14b",
        "r2e_gym",
        1024,
        20,
        ("libra",),
        sweep_steps=0,
        prompts_per_step=256,
        tick_s=10.0,
    ),
}


def sweep_splits(env: Env) -> list[int]:
    return default_splits(env)


def best_settings(
    name: str, env: Env, steps: int, tick: Callable[[], None] | None = None
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Sweep a baseline's fixed split and rollout TP in the simulator; return the best and the sweep."""
    grid: list[dict[str, int]]
    if steps <= 0:
        return {}, []
    if name == "colocated-sync":
        grid = [{"tp": tp} for tp in (1, 2, 4)]
    elif name in ("disaggregated-static", "homogeneous-lb"):
        grid = [{"split": s, "tp": tp} for s in sweep_splits(env) for tp in (1, 2, 4)]
    elif name in ("length-aware", "libra-no-grp"):
        grid = [{"split": s} for s in sweep_splits(env)]
    else:
        return {}, []
    rows = []
    for g in grid:
        try:
            system = build(name, env, **g)
        except ValueError:
            continue
        r, _ = run_system(system, env.workload, env.cm, env.n_gpus, steps, env.seed)
        rows.append({**g, "trajectories_per_s": r["trajectories_per_s"]})
        if tick:
            tick()
    best = max(rows, key=lambda row: row["trajectories_per_s"])
    return {k: v for k, v in best.items() if k in ("split", "tp")}, rows


def run(
    scenario: Scenario,
    seed: int = 0,
    steps: int | None = None,
    systems: Sequence[str] | None = None,
    workload: Workload | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    cm = load_presets(scenario.gpu, scenario.model)
    wl = workload or Workload.load(scenario.workload)
    if scenario.prompts_per_step:
        wl = Workload({**wl.spec, "prompts_per_step": scenario.prompts_per_step})
    env = Env(cm, wl, scenario.n_gpus, seed=seed, plan_steps=scenario.sweep_steps)
    steps = steps or scenario.steps
    names = list(systems or scenario.systems)
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise KeyError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    results: dict[str, Any] = {}
    sweeps: dict[str, Any] = {}
    for name in names:
        settings, rows = best_settings(name, env, scenario.sweep_steps)
        sweeps[name] = {"best": settings, "grid": rows}
        if progress is not None:
            progress.set_postfix_str(name)
        r, sim = run_system(
            build(name, env, **settings), wl, cm, env.n_gpus, steps, seed, scenario.tick_s, progress
        )
        r["timeline"] = sim.timeline
        results[name] = r
    return {
        "scenario": dataclasses.asdict(scenario) | {"steps": steps, "seed": seed, "systems": names},
        "workload": wl.name,
        "prompts_per_step": wl.prompts_per_step,
        "group_size": wl.group_size,
        "systems": results,
        "sweeps": sweeps,
    }
