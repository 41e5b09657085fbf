"""`libra sim`: run a scenario or a workload file against Libra and the baselines."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from services.common.cost_model import Calibration, profile_efficiencies
from services.common.synthetic import Workload
from tools.sim.jobs import SCENARIOS, Runner, Scenario, default_jobs
from tools.sim.scenarios import resolve, run, sweep_size
from tools.sim.systems import ALIASES, SYSTEMS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libra sim", description=__doc__)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="a named scenario")
    p.add_argument("--workload", help="workload YAML file (or a name under services/common/workloads)")
    p.add_argument("--gpus", type=int, default=48, help="cluster size for --workload")
    p.add_argument("--gpu", default="A800", help="hardware preset for --workload (A800, H100, H200)")
    p.add_argument("--model", default="qwen3-14b", help="model preset for --workload")
    p.add_argument(
        "--profile",
        help="a `libra calibrate` profile: the machine and model it measured, with its fitted constants, "
        "instead of the --gpu and --model presets",
    )
    p.add_argument(
        "--efficiencies",
        metavar="PROFILE",
        help="a GPU profile's measured efficiencies (mem_efficiency, prefill_mfu, train_mfu) on the "
        "scenario's own hardware and model, in place of the assumed ones (--calib still overrides)",
    )
    p.add_argument(
        "--systems",
        help=f"comma-separated subset of: {','.join(SYSTEMS)} ({', '.join(f'{a}={b}' for a, b in ALIASES.items())})",
    )
    p.add_argument("--seeds", type=int, help="reported seeds 0..K-1 (default: the scenario's; workloads: 5)")
    p.add_argument("--steps", type=int, help="RL steps to simulate per seed (default: the scenario's)")
    p.add_argument("--staleness", type=int, help="staleness bound of every async system (default 1)")
    p.add_argument(
        "--acceptance-scale",
        type=float,
        help="multiply every drafter's extra accepted tokens per step (default 1: Seer's Table 2)",
    )
    p.add_argument(
        "--calib",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a cost-model constant for a sensitivity run, e.g. tp_decode_efficiency=0.66 "
        "(repeatable; any field of services.common.cost_model.Calibration)",
    )
    p.add_argument("--jobs", type=int, default=default_jobs(), help="parallel simulations (default: up to 2)")
    p.add_argument("--out", type=Path, default=Path("sim-out"), help="directory for results.json and plots")
    p.add_argument("--no-plots", action="store_true")
    return p


def parse_calib(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` for a field of the cost model's `Calibration`, the value cast to its type."""
    key, sep, raw = text.partition("=")
    defaults = Calibration()
    known = [f.name for f in dataclasses.fields(Calibration)]
    if not sep or key not in known:
        raise ValueError(f"--calib {text!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
    current = getattr(defaults, key)
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return key, raw.lower() in ("true", "1")
        value = type(current)(float(raw)) if isinstance(current, int) else float(raw)
    except ValueError:
        raise ValueError(f"--calib {text!r}: {raw!r} is not a {type(current).__name__}") from None
    if value < 0:
        raise ValueError(f"--calib {text!r}: must be at least 0")
    return key, value


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
    for flag in ("seeds", "steps", "gpus", "jobs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"libra sim: --{flag} must be at least 1", file=sys.stderr)
            return 2
    if args.staleness is not None and args.staleness < 0:
        print("libra sim: --staleness must be at least 0", file=sys.stderr)
        return 2
    try:
        if args.scenario:
            scenario = SCENARIOS[args.scenario]
            workload = None
        else:
            workload = Workload.load(args.workload)
            scenario = Scenario(
                f"custom-{workload.name}", args.gpu, args.model, args.workload, args.gpus, 20, SYSTEMS
            )
        if args.staleness is not None:
            scenario = dataclasses.replace(scenario, staleness=args.staleness)
        if args.acceptance_scale is not None:
            if args.acceptance_scale < 0:
                raise ValueError("--acceptance-scale must be at least 0")
            scenario = dataclasses.replace(scenario, acceptance_scale=args.acceptance_scale)
        if args.profile:
            scenario = dataclasses.replace(scenario, profile=args.profile)
        measured = list(profile_efficiencies(args.efficiencies).items()) if args.efficiencies else []
        if args.calib or measured:
            pairs = dict(measured) | dict(parse_calib(c) for c in args.calib)
            scenario = dataclasses.replace(scenario, calibration=tuple(pairs.items()))
        names = resolve([s.strip() for s in args.systems.split(",")] if args.systems else scenario.systems)
        seeds = args.seeds or scenario.seeds
        from tqdm import tqdm

        t0 = time.perf_counter()
        total = sweep_size(Runner(scenario, workload), names) + seeds * len(names)
        with tqdm(total=total, desc=scenario.name, unit="sim", file=sys.stderr) as bar:
            results = run(scenario, seeds, args.steps, names, workload, bar, args.jobs)
        wall = time.perf_counter() - t0
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"libra sim: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
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
    ratios = results.get("ratios_vs_libra", {})
    print(f"{'system':22s} {'traj/s':>7s} {'95% CI':>15s} {'libra x':>7s} {'95% CI':>13s}  settings")
    for name, r in systems.items():
        lo, hi = r["ci95"]
        rat = ratios.get(name)
        rtxt = (
            f"{rat['mean']:7.3f} [{rat['ci95'][0]:.3f}, {rat['ci95'][1]:.3f}]"
            if rat
            else f"{'-':>7s} {'':13s}"
        )
        print(f"{name:22s} {r['trajectories_per_s']:7.3f} [{lo:6.3f}, {hi:6.3f}] {rtxt}  {r['settings']}")
    for name, why in results.get("infeasible", {}).items():
        print(f"{name:22s} not run: {why}")
    print(
        f"wall_s={results['wall_s']:.1f} events={results['events']} events_per_s={results['events_per_s']:.0f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
