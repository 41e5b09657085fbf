"""`python -m tools.sim.horizon --workload NAME [--gpus N] [--staleness ETA]`: Libra's planner's
three best candidates (those it confirms on more planning seeds) scored again at the planning
length (`Scenario.sweep_steps`) and at the reported length (`--steps`, 20), on the reported seeds
and the planning seed, with the groups each run dropped as too stale.

Why: on `search_r1` at η = 2 the planner, when it confirmed its candidates over 8 steps, chose a
plan that was the fastest over them and 0.93x the best baseline over the 20 reported ones
(`docs/simulator.md`); since then every system's candidates are confirmed over the run's length,
and this shows how far apart the two lengths' rankings are."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from services.common.synthetic import Workload
from tools.sim import scenarios
from tools.sim.jobs import Job, Runner, Scenario
from tools.sim.systems import PLAN_SEED


def top_candidates(runner: Runner) -> list[tuple[str, dict[str, Any]]]:
    """The candidates Libra's planner confirmed when `libra sim` chose its settings."""
    _, sweeps = scenarios.choose_settings(runner, ["libra"])
    return [(c["settings"], c["candidate"]) for c in sweeps["libra"]["confirmed"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sim.horizon", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--gpus", type=int, default=48)
    p.add_argument("--gpu", default="A800")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    workload = Workload.load(args.workload)
    scenario = Scenario(
        f"custom-{workload.name}", args.gpu, args.model, args.workload, args.gpus, args.steps, ("libra",)
    )
    scenario = dataclasses.replace(scenario, staleness=args.staleness)
    runner = Runner(scenario, workload, args.jobs)
    candidates = top_candidates(runner)
    seeds = [*range(args.seeds), PLAN_SEED]
    lengths = (scenario.sweep_steps, args.steps)
    jobs = [Job("libra", c, seed, n) for _, c in candidates for n in lengths for seed in seeds]
    outs = iter(runner.run_all(jobs))
    print(f"| plan | steps | {' | '.join(f'seed {s}' for s in seeds)} |")
    print(f"| --- | --- | {' | '.join('---' for _ in seeds)} |")
    for key, _ in candidates:
        for n in lengths:
            cells = []
            for _ in seeds:
                o = next(outs)
                cells.append(f"{o['trajectories_per_s']:.3f} ({o['dropped_stale_groups']} dropped)")
            print(f"| {key} | {n} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
