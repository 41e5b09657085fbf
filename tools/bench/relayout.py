"""Re-laying out the engines as the workload drifts (`planner.relayout`), in the simulator: the
job of `configs/drift.yaml` (32 emulated H100s for Qwen3-14B, 8 training GPUs, rollout's 24 as
8 TP1 + 8 TP2 engines to start, the planner re-fitting every 20 wall seconds) simulated as the live
job (`services/simulation/live.py`) with the planner re-fitting thresholds only, and re-fitting and
re-laying out the engines. Gains are paired per seed (the same workload sample) with 95 %
confidence intervals; `libra run configs/drift.yaml` (with `--planner.relayout false` for the
other) checks the first case live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

NAME = "relayout"
SEEDS = 8
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "drift.yaml"
CASES: dict[str, dict[str, Any]] = {
    "r2e_gym_drift from 8xTP1 + 8xTP2 (configs/drift.yaml)": {},
    "r2e_gym from 8xTP1 + 8xTP2": {"task": {"workload": "r2e_gym"}},
    "math_code from 8xTP1 + 8xTP2": {"task": {"workload": "math_code"}},
    "r2e_gym_drift from 1xTP4 + 5xTP4 (the layout its first re-layout picks)": {
        "rollout": {
            "engines": 6,
            "buckets": [
                {"name": "short", "tensor_parallel": 4, "engines": 1, "max_output_tokens": 7677},
                {"name": "long", "tensor_parallel": 4, "engines": 5},
            ],
        }
    },
    "r2e_gym_drift from 8xTP1 + 8xTP2, staleness 2": {"training": {"max_staleness": 2}},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def case(overrides: dict[str, Any], seeds: int = SEEDS) -> dict[str, Any]:
    from services.common.runconfig import RunConfig
    from services.common.synthetic import Workload
    from services.simulation.live import simulate
    from tools.sim.stats import mean_ci

    data = _merge(yaml.safe_load(CONFIG.read_text()), overrides)
    runs: dict[str, list[dict[str, Any]]] = {}
    for relayout in (False, True):
        data["planner"]["relayout"] = relayout
        cfg = RunConfig.model_validate(data)
        workload = Workload.load(cfg.task.workload or "")
        runs["relayout" if relayout else "refit"] = [simulate(cfg, workload, seed) for seed in range(seeds)]
    rate = {k: [r["trajectories_per_s"] for r in v] for k, v in runs.items()}
    gains = [a / b - 1 for a, b in zip(rate["relayout"], rate["refit"], strict=True)]
    m, ci = mean_ci(gains)
    first = runs["relayout"][0]["replans"]
    return {
        "refit_trajectories_per_s": mean_ci(rate["refit"])[0],
        "relayout_trajectories_per_s": mean_ci(rate["relayout"])[0],
        "gain": m,
        "ci95": list(ci),
        "per_seed": gains,
        "relayouts_seed0": sum(r["relayout"] for r in first),
        "refits_seed0": sum(r["applied"] and not r["relayout"] for r in first),
    }


def run() -> dict[str, Any]:
    results = {label: case(o) for label, o in tqdm(CASES.items(), desc="relayout cases", unit="case")}
    rows = [
        [
            f"{label}: re-layout over thresholds alone",
            f"{r['gain']:+.1%} [{r['ci95'][0]:+.1%}, {r['ci95'][1]:+.1%}]",
            f"{r['refit_trajectories_per_s']:.4f} -> {r['relayout_trajectories_per_s']:.4f} traj/s; seed 0: "
            f"{r['relayouts_seed0']} re-layouts, {r['refits_seed0']} threshold re-fits",
        ]
        for label, r in results.items()
    ]
    return {
        "title": f"Re-laying out the engines live, in the simulator ({SEEDS} seeds, paired gains, 95% CIs)",
        "command": "python -m tools.bench relayout",
        "rows": rows,
        "results": {"seeds": SEEDS, "cases": results},
    }
