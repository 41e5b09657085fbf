"""Every system compared at the same staleness: throughput against the staleness of what it trains.

A staleness bound η is a knob, not a workload property: a system that fills the bound further
trains staler data, and comparing two systems at the same η can compare different amounts of
off-policy data. `python -m tools.sim.frontier DIR [DIR ...] --out DIR` reads the results of the
same scenario run at several bounds (`libra sim --staleness η --out DIR`, same seeds) and compares
each baseline run with the fastest Libra run whose trained tokens are **no staler** (mean token
staleness, `trained_token_staleness_mean`, each generated token counted at the version that
generated it). Ratios are paired by seed (the same trajectories on both sides). Writes
`frontier.json`, `frontier.md` (a table) and `frontier.png` (throughput against token staleness,
one line per system).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tools.sim.stats import mean_ci, paired_ratio

REFERENCE = "libra"
TOLERANCE = 0.05
"""Versions by which Libra's mean token staleness may exceed a baseline's and still count as no
staler: the seed-to-seed noise of a 3-seed mean (its spread over seeds is a few hundredths)."""


def load(dirs: list[Path]) -> list[dict[str, Any]]:
    """The runs' results, checked to be comparable: same scenario, workload and reported seeds,
    distinct staleness bounds, each with Libra in it."""
    runs = []
    for d in dirs:
        path = d / "results.json" if d.is_dir() else d
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a results.json ({e})") from None
    if not runs:
        raise ValueError("no runs given")
    first = runs[0]
    for r, d in zip(runs, dirs, strict=True):
        for key in ("workload", "reported_seeds"):
            if r.get(key) != first.get(key):
                raise ValueError(f"{d}: {key} {r.get(key)!r} differs from {first.get(key)!r} of {dirs[0]}")
        if (
            r["scenario"]["name"] != first["scenario"]["name"]
            or r["scenario"]["n_gpus"] != first["scenario"]["n_gpus"]
        ):
            raise ValueError(f"{d}: a different scenario from {dirs[0]}")
        if REFERENCE not in r["systems"]:
            raise ValueError(f"{d}: has no {REFERENCE} run to compare with")
    etas = [r["scenario"]["staleness"] for r in runs]
    if len(set(etas)) != len(etas):
        raise ValueError(f"staleness bounds repeat: {etas}")
    return sorted(runs, key=lambda r: r["scenario"]["staleness"])


def points(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per system, one point per run: its bound, token staleness, throughput and per-seed throughput."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        for name, s in r["systems"].items():
            out.setdefault(name, []).append(
                {
                    "staleness_bound": r["scenario"]["staleness"],
                    "token_staleness": s["trained_token_staleness_mean"],
                    "admission_staleness": s["trained_staleness_mean"],
                    "trajectories_per_s": s["trajectories_per_s"],
                    "by_seed": s["trajectories_per_s_by_seed"],
                    "settings": s["settings"],
                }
            )
    return out


def compare(pts: dict[str, list[dict[str, Any]]], tolerance: float = TOLERANCE) -> list[dict[str, Any]]:
    """For each point of another system, the fastest Libra point that trains no staler tokens
    (within `tolerance` versions), and Libra's throughput over the other's (paired by seed).
    `libra` is None where no Libra run is as fresh."""
    rows = []
    ref = pts[REFERENCE]
    for name, ps in pts.items():
        if name == REFERENCE:
            continue
        for p in ps:
            fresher = [q for q in ref if q["token_staleness"] <= p["token_staleness"] + tolerance]
            row: dict[str, Any] = {"system": name, **{k: v for k, v in p.items() if k != "by_seed"}}
            if not fresher:
                row["libra"] = None
            else:
                q = max(fresher, key=lambda q: q["trajectories_per_s"])
                mean, ci = paired_ratio(q["by_seed"], p["by_seed"])
                row["libra"] = {k: v for k, v in q.items() if k != "by_seed"}
                row["ratio"] = {"mean": mean, "ci95": list(ci)}
            rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline point Libra leads least at equal or lower staleness (Libra's own ablations
    aside), and the points with no Libra run as fresh."""
    judged = [r for r in rows if r["libra"] is not None and not r["system"].startswith("libra-")]
    worst = min(judged, key=lambda r: r["ratio"]["mean"]) if judged else None
    return {
        "worst": worst
        and {
            "system": worst["system"],
            "staleness_bound": worst["staleness_bound"],
            "ratio": worst["ratio"],
        },
        "unmatched": [(r["system"], r["staleness_bound"]) for r in rows if r["libra"] is None],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| system | η | token staleness | traj/s | Libra's run (η, token staleness, traj/s) | Libra / system | 95 % CI |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for r in rows:
        head = f"| {r['system']} | {r['staleness_bound']} | {r['token_staleness']:.2f} | {r['trajectories_per_s']:.3f} |"
        q = r["libra"]
        if q is None:
            lines.append(head + " no Libra run as fresh | — | — |")
            continue
        lo, hi = r["ratio"]["ci95"]
        lines.append(
            head + f" η = {q['staleness_bound']}, {q['token_staleness']:.2f}, {q['trajectories_per_s']:.3f} |"
            f" {r['ratio']['mean']:.3f} | [{lo:.3f}, {hi:.3f}] |"
        )
    return "\n".join(lines) + "\n"


def plot(pts: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, ps in pts.items():
        if name.startswith("libra-"):
            continue  # ablations: in the table, not the picture
        xs = [p["token_staleness"] for p in ps]
        ys = [p["trajectories_per_s"] for p in ps]
        cis = [mean_ci(p["by_seed"])[1] for p in ps]
        err = [
            [y - c[0] for y, c in zip(ys, cis, strict=True)],
            [c[1] - y for y, c in zip(ys, cis, strict=True)],
        ]
        style = {"color": "tab:green", "linewidth": 2.5} if name == REFERENCE else {"linewidth": 1.2}
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name, **style)
        for p in ps:
            ax.annotate(
                f"η={p['staleness_bound']}",
                (p["token_staleness"], p["trajectories_per_s"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("mean staleness of trained tokens (policy versions)")
    ax.set_ylabel("trajectories / s (95% CI over seeds)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sim.frontier", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="result directories (or results.json files)")
    p.add_argument("--out", type=Path, default=Path("sim-frontier"))
    p.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="versions by which Libra's token staleness may exceed a baseline's and count as no staler",
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        runs = load(args.runs)
    except ValueError as e:
        print(f"frontier: {e}", file=sys.stderr)
        return 2
    pts = points(runs)
    if args.tolerance < 0:
        print("frontier: --tolerance must be >= 0", file=sys.stderr)
        return 2
    rows = compare(pts, args.tolerance)
    out = {
        "scenario": runs[0]["scenario"]["name"],
        "staleness_bounds": [r["scenario"]["staleness"] for r in runs],
        "tolerance": args.tolerance,
        "points": pts,
        "comparisons": rows,
        "summary": summary(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontier.json").write_text(json.dumps(out, indent=2))
    md = table(rows)
    (args.out / "frontier.md").write_text(md)
    if not args.no_plot:
        plot(pts, args.out / "frontier.png", f"{out['scenario']}: throughput against staleness")
    print(md, end="")
    worst = out["summary"]["worst"]
    if worst:
        lo, hi = worst["ratio"]["ci95"]
        print(
            f"\nLibra's smallest lead over a baseline at equal or lower token staleness: {worst['ratio']['mean']:.3f}x "
            f"[{lo:.3f}, {hi:.3f}] over {worst['system']} at η = {worst['staleness_bound']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
