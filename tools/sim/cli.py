"""`libra sim`: run a scenario or a workload file against Libra and the baselines."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tools.sim.scenarios import SCENARIOS, Scenario, run
from tools.sim.systems import SYSTEMS
from tools.sim.workload import Workload


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libra sim", description=__doc__)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="a named scenario")
    p.add_argument("--workload", help="workload YAML file (or a name under tools/sim/workloads)")
    p.add_argument("--gpus", type=int, default=48, help="cluster size for --workload")
    p.add_argument("--gpu", default="A800", help="hardware preset for --workload (A800, H100, H200)")
    p.add_argument("--model", default="qwen3-14b", help="model preset for --workload")
    p.add_argument("--systems", help=f"comma-separated subset of: {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="RL steps to simulate (default: the scenario's)")
    p.add_argument("--out", type=Path, default=Path("sim-out"), help="directory for results.json and plots")
    p.add_argument("--no-plots", action="store_true")
    return p


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if bool(args.scenario) == bool(args.workload):
        print("libra sim: give exactly one of --scenario or --workload", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",")] if args.systems else None
    try:
        if args.scenario:
            scenario = SCENARIOS[args.scenario]
            workload = None
        else:
            workload = Workload.load(args.workload)
            scenario = Scenario(
                f"custom-{workload.name}", args.gpu, args.model, args.workload, args.gpus, 10, SYSTEMS
            )
        steps = args.steps or scenario.steps
        names = systems or list(scenario.systems)
        from tqdm import tqdm

        t0 = time.perf_counter()
        with tqdm(total=steps * len(names), desc=scenario.name, unit="step", file=sys.stderr) as bar:
            results = run(scenario, args.seed, steps, names, workload, bar)
        wall = time.perf_counter() - t0
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"libra sim: {e}", file=sys.stderr)
        return 2
    events = sum(r["events"] for r in results["systems"].values())
    results["wall_s"] = wall
    results["events"] = events
    results["events_per_s"] = events / wall if wall else 0.0
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.json", "w") as f:
        json.dump(_jsonable(results), f, indent=1)
    if not args.no_plots:
        from tools.sim.plots import write_plots

        write_plots(results, args.out)
    _print_table(results)
    return 0


def _print_table(results: dict[str, Any]) -> None:
    systems = results["systems"]
    ref = systems.get("libra", {}).get("trajectories_per_s")
    print(f"{'system':24s} {'traj/s':>8s} {'tok/s':>9s} {'libra x':>8s} {'p50 s':>7s} {'p99 s':>7s}")
    for name, r in systems.items():
        ratio = f"{ref / r['trajectories_per_s']:.2f}" if ref else "-"
        print(
            f"{name:24s} {r['trajectories_per_s']:8.3f} {r['trained_tokens_per_s']:9.0f} {ratio:>8s} "
            f"{r['rollout_latency_p50_s']:7.0f} {r['rollout_latency_p99_s']:7.0f}"
        )
    print(
        f"wall_s={results['wall_s']:.1f} events={results['events']} events_per_s={results['events_per_s']:.0f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
