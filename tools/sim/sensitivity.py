"""How Libra's lead over the best baseline moves when one uncited constant moves.

`python -m tools.sim.sensitivity --out DIR` runs a scenario once as shipped, then once with each
cost-model constant that no source pins down moved by -25 % and +25 % (`--delta`), and with the
drafters' acceptance halved and raised by half. Every run re-chooses every system's settings, so
each point is what the simulator would conclude had that constant been different. Writes
`sensitivity.json`, `sensitivity.md` (a table) and `sensitivity.png` (a tornado plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from services.common.cost_model import Calibration
from tools.sim.jobs import SCENARIOS, default_jobs
from tools.sim.scenarios import resolve, run

CONSTANTS = (
    "tp_decode_efficiency",
    "decode_overhead_s",
    "mem_efficiency",
    "prefill_mfu",
    "train_mfu",
    "tp_mfu_decay",
    "colocate_fixed_s",
)
"""Calibration fields whose value no measurement or publication fixes (docs/simulator.md)."""
FRACTIONS = ("mem_efficiency", "prefill_mfu", "train_mfu", "tp_decode_efficiency", "tp_mfu_decay")
"""Constants that cannot exceed 1."""
SYSTEMS = "libra,verl-apr,areal,areal-sd,areal-lend"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.sim.sensitivity", description=__doc__)
    p.add_argument("--scenario", default="paper-48gpu", choices=sorted(SCENARIOS))
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, help="RL steps per seed (default: the scenario's)")
    p.add_argument("--delta", type=float, default=0.25, help="relative move of each constant")
    p.add_argument("--systems", default=SYSTEMS, help="Libra and the baselines to compare with")
    p.add_argument("--constants", default=",".join(CONSTANTS))
    p.add_argument("--jobs", type=int, default=default_jobs())
    p.add_argument("--out", type=Path, default=Path("sim-sensitivity"))
    return p


def lead(results: dict[str, Any]) -> dict[str, Any]:
    """Libra over the best other system of one run (by mean throughput), with the paired CI."""
    others = {n: r for n, r in results["systems"].items() if n != "libra"}
    best = max(others, key=lambda n: others[n]["trajectories_per_s"])
    ratio = results["ratios_vs_libra"][best]
    return {"best": best, "mean": ratio["mean"], "ci95": ratio["ci95"], "settings": others[best]["settings"]}


def points(constants: list[str], delta: float) -> list[tuple[str, str, dict[str, Any]]]:
    """(constant, label, scenario changes): the shipped run, then each constant low and high."""
    base = Calibration()
    out: list[tuple[str, str, dict[str, Any]]] = [("as shipped", "", {})]
    for name in constants:
        value = getattr(base, name)
        for sign in (-1, 1):
            moved = value * (1 + sign * delta)
            if name in FRACTIONS:
                moved = min(1.0, moved)
            if moved == value:
                continue
            out.append((name, f"{moved:.4g}", {"calibration": ((name, moved),)}))
    for scale in (1 - 2 * delta, 1 + 2 * delta):
        out.append(("acceptance_scale", f"{scale:.4g}", {"acceptance_scale": scale}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    constants = [c.strip() for c in args.constants.split(",") if c.strip()]
    known = {f.name for f in dataclasses.fields(Calibration)}
    unknown = [c for c in constants if c not in known]
    if unknown or not 0 < args.delta < 1 or args.seeds < 1:
        print(
            f"sensitivity: unknown constants {unknown}"
            if unknown
            else "sensitivity: need 0 < delta < 1, seeds >= 1",
            file=sys.stderr,
        )
        return 2
    names = resolve([s.strip() for s in args.systems.split(",")])
    if "libra" not in names or len(names) < 2:
        print("sensitivity: --systems must name libra and at least one baseline", file=sys.stderr)
        return 2
    base = dataclasses.replace(SCENARIOS[args.scenario], staleness=args.staleness)
    rows = []
    from tqdm import tqdm

    grid = points(constants, args.delta)
    t0 = time.perf_counter()
    for constant, value, change in tqdm(grid, desc="sensitivity", unit="run", file=sys.stderr):
        results = run(dataclasses.replace(base, **change), args.seeds, args.steps, names, jobs=args.jobs)
        rows.append({"constant": constant, "value": value, **lead(results)})
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "scenario": args.scenario,
        "staleness": args.staleness,
        "seeds": args.seeds,
        "delta": args.delta,
        "systems": names,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    (args.out / "sensitivity.json").write_text(json.dumps(report, indent=1))
    table = [
        "| constant | value | best baseline | Libra / best | 95 % CI |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for r in rows:
        lo, hi = r["ci95"]
        table.append(
            f"| {r['constant']} | {r['value']} | {r['best']} | {r['mean']:.3f} | [{lo:.3f}, {hi:.3f}] |"
        )
    (args.out / "sensitivity.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    _plot(rows, args.out / "sensitivity.png")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]["mean"]
    names = list(dict.fromkeys(r["constant"] for r in rows[1:]))
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    for i, name in enumerate(names):
        for k, r in enumerate(r for r in rows if r["constant"] == name):
            ax.plot([base, r["mean"]], [i, i], color="tab:gray", lw=6, solid_capstyle="butt")
            ax.errorbar(
                r["mean"],
                i,
                xerr=[[r["mean"] - r["ci95"][0]], [r["ci95"][1] - r["mean"]]],
                fmt="o",
                color="k",
            )
            offset = (0, 7) if k % 2 else (0, -13)  # the low value's label below, the high one's above
            ax.annotate(
                r["value"], (r["mean"], i), textcoords="offset points", xytext=offset, ha="center", fontsize=7
            )
    ax.axvline(base, color="tab:green", label=f"as shipped {base:.3f}")
    ax.axvline(1.0, color="tab:red", ls="--", label="tie")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("Libra / best baseline (95 % CI)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
