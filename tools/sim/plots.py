"""Plots for a scenario's results: throughput bars, step-time series, GPU timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    systems = results["systems"]
    names = list(systems)
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4))
    vals = [systems[n]["trajectories_per_s"] for n in names]
    colors = [
        "tab:green" if n == "libra" else "tab:olive" if n.startswith("libra-") else "tab:gray" for n in names
    ]
    err = [
        [v - systems[n]["ci95"][0] for n, v in zip(names, vals, strict=True)],
        [systems[n]["ci95"][1] - v for n, v in zip(names, vals, strict=True)],
    ]
    ax.bar(names, vals, color=colors, yerr=err, capsize=3)
    ratios = results.get("ratios_vs_libra", {})
    for i, (n, v) in enumerate(zip(names, vals, strict=True)):
        label = f"{v:.3f}" + (f"\n({ratios[n]['mean']:.2f}x)" if n in ratios else "")
        ax.text(i, systems[n]["ci95"][1], label, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("trajectories / s (steady state, 95% CI)")
    ax.set_title(f"{results['scenario']['name']}: throughput")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        st = systems[n]["step_times_s"]
        ax.plot(range(1, len(st) + 1), st, marker="o", label=n)
    ax.set_xlabel("RL step (seed 0)")
    ax.set_ylabel("step time (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "step_times.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    shown = [n for n in names if systems[n].get("timeline")]
    if shown:
        fig, axes = plt.subplots(len(shown), 1, figsize=(8, 1.6 * len(shown)), sharex=True, squeeze=False)
        for ax, n in zip(axes[:, 0], shown, strict=True):
            tl = systems[n]["timeline"]
            t = [row[0] for row in tl]
            ax.stackplot(
                t,
                [row[1] for row in tl],
                [row[2] for row in tl],
                [row[3] for row in tl],
                labels=["rollout", "training", "switch/sync"],
                colors=["tab:blue", "tab:orange", "tab:red"],
            )
            ax.set_ylabel(n, rotation=0, ha="right", fontsize=8)
        axes[0, 0].legend(loc="upper right", fontsize=7)
        axes[-1, 0].set_xlabel("simulated time (s): busy GPUs by stage")
        fig.tight_layout()
        paths.append(out / "gpu_timeline.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
