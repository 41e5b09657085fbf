"""`runs/<id>/reward.png`: what a job learned, step by step (reward with its 95 % interval, the
policy's entropy, the engine-vs-trainer logprob mismatch), drawn from its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_reward_plot(report: dict[str, Any], out_dir: Path) -> Path | None:
    """None when the job trained no step."""
    rewards = report.get("reward_mean_per_step") or []
    if not rewards:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    cis = report.get("reward_ci95_per_step") or [[r, r] for r in rewards]
    stats = report.get("training_stats", {})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[2, 1])
    lo = [r - c[0] for r, c in zip(rewards, cis, strict=True)]
    hi = [c[1] - r for r, c in zip(rewards, cis, strict=True)]
    top.errorbar(
        steps, rewards, yerr=[lo, hi], fmt="o-", capsize=3, color="tab:green", label="mean reward (95% CI)"
    )
    if stats.get("trained_reward_mean"):
        top.plot(steps, stats["trained_reward_mean"], "x--", color="tab:gray", label="trained groups only")
    for key, label, color in (
        ("reward_first3", "first 3 steps", "tab:blue"),
        ("reward_last3", "last 3 steps", "tab:red"),
    ):
        w = report.get(key)
        if w:
            top.axhspan(
                w["ci95"][0], w["ci95"][1], alpha=0.12, color=color, label=f"{label}: {w['mean']:.3f}"
            )
    rounds = [r for r in report.get("eval") or [] if r.get("reward_mean") is not None]
    if rounds:
        x = [r["version"] for r in rounds]
        means = [r["reward_mean"] for r in rounds]
        ci = [r.get("ci95") or [m, m] for r, m in zip(rounds, means, strict=True)]
        top.errorbar(
            x,
            means,
            yerr=[
                [m - c[0] for m, c in zip(means, ci, strict=True)],
                [c[1] - m for m, c in zip(means, ci, strict=True)],
            ],
            fmt="D-",
            capsize=3,
            color="tab:red",
            label="held-out eval after step (95% CI)",
        )
    top.set_ylabel("reward per trajectory")
    # the run id on a line of its own: a long one would push the title past the figure's edge
    top.set_title(
        f"{report.get('run_id', '')}\nreward by step (trajectories of successive policies)", fontsize=10
    )
    top.legend(fontsize=8, loc="best")
    entropy = [e if e is not None else float("nan") for e in stats.get("entropy") or []]
    if any(e == e for e in entropy):  # some step measured it (NaN != NaN)
        bottom.plot(steps[: len(entropy)], entropy, "o-", color="tab:purple", label="entropy (nats/token)")
    else:  # an empty panel reads as a broken plot: say why it is empty
        bottom.text(
            0.5, 0.5, "no step measured entropy", ha="center", va="center", transform=bottom.transAxes
        )
    from matplotlib.ticker import MaxNLocator

    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("train step")
    bottom.set_ylabel("entropy")
    mismatch = report.get("logprob_mismatch_per_step") or []
    if any(m is not None for m in mismatch):
        twin = bottom.twinx()
        twin.plot(steps, [m if m is not None else float("nan") for m in mismatch], "s:", color="tab:orange")
        twin.set_ylabel("|logprob mismatch|", color="tab:orange")
    fig.tight_layout()
    path = out_dir / "reward.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
