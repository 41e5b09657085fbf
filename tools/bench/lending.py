"""Lending policies in the simulator: when the trainer lends its GPUs to rollout, and when it takes
them back (`planner.lending.policy`), on `libra bench live`'s configuration over several workloads.

Each case is simulated three times on the same seeds: no lending (`libra`), lending at every wait
(`always`: the GPUs come back when a batch is complete, so the switch delays the step), and the
forecast (`predictive`: lend only when the batch is forecast more than three switches off, take the
GPUs back one switch before it is forecast complete). Gains are paired per seed (same workload
sample) with 95 % confidence intervals. The configurations are the ones `libra bench live` runs
live (emulated engines and training), so the live runs check these predictions.
"""

from __future__ import annotations

import argparse
from typing import Any

from tqdm import tqdm

NAME = "lending"
SEEDS = 8
STEPS = 14
CASES: dict[str, dict[str, Any]] = {
    "r2e_gym, 8 training GPUs, 8 groups/step (bench live's default)": {},
    "r2e_gym, 32 training GPUs, 32 groups/step": {"train_gpus": 32, "groups_per_step": 32},
    "r2e_gym, 32 training GPUs, 32 groups/step, staleness 2": {
        "train_gpus": 32,
        "groups_per_step": 32,
        "staleness": 2,
    },
    "math_code, 32 training GPUs, 32 groups/step": {
        "workload": "math_code",
        "train_gpus": 32,
        "groups_per_step": 32,
    },
    "search_r1, 32 training GPUs, 32 groups/step": {
        "workload": "search_r1",
        "train_gpus": 32,
        "groups_per_step": 32,
    },
}
LEND_POLICIES = ("always", "predictive")


def namespace(**overrides: Any) -> argparse.Namespace:
    """`libra bench live`'s arguments at their defaults (16 engines, TP4 lent engines), with
    `overrides` and this benchmark's steps."""
    from tools.bench_live import parser

    ns = parser().parse_args(["--out", "unused", "--steps", str(STEPS)])
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def case(overrides: dict[str, Any], seeds: int = SEEDS) -> dict[str, Any]:
    from services.common.runconfig import RunConfig
    from services.common.synthetic import Workload
    from tools.bench_live import live_config, predicted
    from tools.sim.stats import mean_ci

    ns = namespace(**overrides)
    workload = Workload.load(ns.workload)
    runs = {}
    for lend in (None, *LEND_POLICIES):
        cfg = RunConfig.model_validate(live_config(ns, workload, "cmlfq", lend=lend))
        runs[lend or "libra"] = predicted(cfg, workload, seeds)
    base = runs["libra"]["per_seed_trajectories_per_s"]
    out: dict[str, Any] = {"libra_trajectories_per_s": runs["libra"]["over_seeds"]["trajectories_per_s"]}
    for policy in LEND_POLICIES:
        ratios = [a / b - 1 for a, b in zip(runs[policy]["per_seed_trajectories_per_s"], base, strict=True)]
        m, ci = mean_ci(ratios)
        out[policy] = {
            "gain": m,
            "ci95": list(ci),
            "per_seed": ratios,
            "trajectories_per_s": runs[policy]["over_seeds"]["trajectories_per_s"],
            "lending_seed0": runs[policy]["lending"],
        }
    return out


def run() -> dict[str, Any]:
    results = {}
    for label, overrides in tqdm(CASES.items(), desc="lending cases", unit="case"):
        results[label] = case(overrides)
    rows: list[list[Any]] = []
    for label, r in results.items():
        for policy in LEND_POLICIES:
            p = r[policy]
            lo, hi = p["ci95"]
            lend = p["lending_seed0"]
            rows.append(
                [
                    f"{label}: {policy} lending over none",
                    f"{p['gain']:+.1%} [{lo:+.1%}, {hi:+.1%}]",
                    f"seed 0: lent {lend['lends']} times, {lend['early_reclaims']} of {lend['reclaims']} "
                    "taken back ahead of the batch",
                ]
            )
    return {
        "title": f"Lending policies in the simulator ({SEEDS} seeds, {STEPS} steps, paired gains, 95% CIs)",
        "command": "python -m tools.bench lending",
        "rows": rows,
        "results": {"seeds": SEEDS, "steps": STEPS, "cases": results},
    }
