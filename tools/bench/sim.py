"""Simulator: Libra's throughput against every baseline on paper-48gpu, and the speed of scale-1024.

Both scenarios run through `libra sim` (tools.sim.cli) in this process; the throughput ratios are
Libra over each baseline within the same run (same workload, seeds and GPUs). The simulator is a
model of a cluster, not a measurement of one: see docs/simulator.md for what it does and does not
capture.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

NAME = "sim"


def _scenario(name: str, out: Path) -> dict[str, Any]:
    from tools.sim.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["--scenario", name, "--out", str(out / name), "--no-plots"])
    if code != 0:
        raise RuntimeError(f"libra sim --scenario {name} exited with {code}")
    results: dict[str, Any] = json.loads((out / name / "results.json").read_text())
    return results


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        paper = _scenario("paper-48gpu", Path(tmp))
        scale = _scenario("scale-1024", Path(tmp))
    systems = paper["systems"]
    rows: list[list[Any]] = []
    for name, ratio in paper["ratios_vs_libra"].items():
        lo, hi = ratio["ci95"]
        r = systems[name]
        rows.append(
            [
                f"paper-48gpu: libra / {name} (trajectories/s, {paper['scenario']['seeds']} seeds)",
                f"{ratio['mean']:.3f}x [{lo:.3f}, {hi:.3f}]",
                f"{name} {r['trajectories_per_s']:.3f} traj/s at {r['settings']}",
            ]
        )
    libra_scale = scale["systems"]["libra"]
    rows += [
        ["paper-48gpu wall time", f"{paper['wall_s']:.1f} s", f"{paper['events']} events, sweeps and seeds"],
        [
            "scale-1024 wall time",
            f"{scale['wall_s']:.1f} s",
            f"{libra_scale['trajectories_per_step']:.0f} trajectories/step; target: under 60 s on one core",
        ],
        ["scale-1024 events/s", f"{scale['events_per_s']:.0f}", f"{scale['events']} events"],
    ]
    return {
        "title": "Simulator: Libra vs baselines (paper-48gpu, 95% CIs over seeds) and simulator speed (scale-1024)",
        "command": "python -m tools.bench sim",
        "rows": rows,
        "results": {
            "paper_48gpu": {n: {k: v for k, v in r.items() if k != "timeline"} for n, r in systems.items()},
            "ratios_vs_libra": paper["ratios_vs_libra"],
            "paper_wall_s": paper["wall_s"],
            "scale_1024": {k: scale[k] for k in ("wall_s", "events", "events_per_s")},
        },
    }
