"""The layout searched from the workload (`planner.layout.search`) against the config's own and
against the best homogeneous split an operator would tune, in the simulator, on seeds the search
never saw.

Each case is `libra bench live`'s configuration (16 engines, half TP1 and half TP2, training on
the rest) on one workload and GPU count. The search (`tools/layout.py`) picks a layout from the
planning seeds (the job's seed and the next `seeds - 1`); both layouts are then simulated on
`SEEDS` other seeds and compared per seed (paired gains, 95 % CIs), so the figure is free of the
search's own luck (choosing the best of many noisy scores over-states it on the seeds it chose
by). The tuned baseline is the same search over an AReaL-style menu only (every training split
with one bucket of every TP, no lending), chosen on the same planning seeds: what a skilled
operator gets by trying every split and TP. A case with more GPUs scales the config's layout.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

NAME = "layout"
SEEDS = 8
HELD_OUT = 100
"""The first held-out seed (the search uses the job's seed 0 and the next few)."""
STEPS = 10
CASES: dict[str, dict[str, Any]] = {
    "r2e_gym, 32 GPUs (bench live's default)": {},
    "r2e_gym, 32 GPUs, 32 groups/step": {"groups_per_step": 32},
    "r2e_gym, 64 GPUs, 32 groups/step": {
        "engines": 32,
        "train_gpus": 16,
        "groups_per_step": 32,
    },
    "math_code, 32 GPUs, 32 groups/step": {"workload": "math_code", "groups_per_step": 32},
    "search_r1, 32 GPUs, 32 groups/step": {"workload": "search_r1", "groups_per_step": 32},
}


def case(overrides: dict[str, Any], seeds: int = SEEDS) -> dict[str, Any]:
    from services.common.runconfig import RunConfig
    from services.common.synthetic import Workload
    from services.simulation.live import simulate
    from tools.bench.lending import namespace
    from tools.bench_live import live_config
    from tools.layout import choose_layout
    from tools.sim.stats import mean_ci

    ns = namespace(**overrides)
    ns.steps = STEPS
    workload = Workload.load(ns.workload)
    data = live_config(ns, workload, "cmlfq")
    data["planner"]["layout"] = {"search": True, "max_engines": 64}
    own = RunConfig.model_validate(data)
    chosen, decision = choose_layout(own, workload, progress=False)
    tuned, tuned_decision = choose_layout(own, workload, progress=False, homogeneous=True)
    held = range(HELD_OUT, HELD_OUT + seeds)
    rates = {
        name: [simulate(c, workload, s)["trajectories_per_s"] for s in held]
        for name, c in (("config", own), ("tuned", tuned), ("chosen", chosen))
    }

    def gain(over: str) -> dict[str, Any]:
        ratios = [a / b - 1 for a, b in zip(rates["chosen"], rates[over], strict=True)]
        m, ci = mean_ci(ratios)
        return {"gain": m, "ci95": list(ci), "per_seed": ratios}

    return {
        "config": decision["config"]["label"],
        "tuned": tuned_decision["chosen"],
        "chosen": decision["chosen"],
        "engines": decision["engines"],
        "search_s": decision["seconds"],
        "searched": decision["scored"],
        "predicted_gain_on_planning_seeds": decision["predicted_gain"],
        "over_config": gain("config"),
        "over_tuned": gain("tuned"),
        "trajectories_per_s": {k: mean_ci(v)[0] for k, v in rates.items()},
    }


def run() -> dict[str, Any]:
    results = {}
    for label, overrides in tqdm(CASES.items(), desc="layout cases", unit="case"):
        results[label] = case(overrides)
    rows: list[list[Any]] = []
    for label, r in results.items():
        for over, name in (
            ("over_config", r["config"].removesuffix(" (config)")),
            ("over_tuned", r["tuned"]),
        ):
            g = r[over]
            lo, hi = g["ci95"]
            what = "the config's" if over == "over_config" else "the tuned homogeneous split's"
            rows.append(
                [
                    f"{label}: searched layout over {what} ({name})",
                    "the same layout" if name == r["chosen"] else f"{g['gain']:+.1%} [{lo:+.1%}, {hi:+.1%}]",
                    f"chose {r['chosen']} ({r['engines']} engines) from {r['searched']} scored in "
                    f"{r['search_s']:.0f} s"
                    + (
                        f"; on the planning seeds {r['predicted_gain_on_planning_seeds']:+.1%}"
                        if over == "over_config"
                        else ""
                    ),
                ]
            )
    return {
        "title": f"Layout searched from the workload, in the simulator ({SEEDS} held-out seeds, {STEPS} steps, "
        "paired gains, 95% CIs)",
        "command": "python -m tools.bench layout",
        "rows": rows,
        "results": {"seeds": SEEDS, "held_out_from": HELD_OUT, "steps": STEPS, "cases": results},
    }
