"""`runs/<id>/throughput.png`, `tools.png`, `engines.png`: what a run did over time, drawn from the
timeline `libra run` records while it watches the job (scheduler stats every second, every
engine's load reports, each step's metrics), saved beside them as `timeline.json`. Written at the
end of the run and refreshed every minute while it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATUS_COLORS = {
    "ok": "tab:green",
    "error": "tab:red",
    "timeout": "tab:orange",
    "killed": "tab:purple",
    "rejected": "tab:gray",
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate(ts: list[float], counts: list[float], window_s: float = 30.0) -> list[float]:
    """Trajectories per second over the trailing window at each sample."""
    out, j = [], 0
    for i, t in enumerate(ts):
        while ts[j] < t - window_s:
            j += 1
        span = t - ts[j]
        out.append((counts[i] - counts[j]) / span if span > 0 else 0.0)
    return out


def _throughput(timeline: dict[str, Any], title: str, out: Path) -> Path | None:
    samples, steps = timeline.get("samples") or [], timeline.get("steps") or []
    if len(samples) < 2:
        return None
    plt = _plt()
    ts = [s["t"] for s in samples]
    done = [s["completed"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), height_ratios=[3, 2])
    top.plot(ts, done, color="tab:blue", label="trajectories completed")
    top.plot(ts, [s["in_flight"] for s in samples], color="tab:gray", lw=0.8, label="in flight")
    top.set_ylabel("trajectories")
    right = top.twinx()
    right.plot(ts, _rate(ts, done), color="tab:orange", lw=1, label="per second (30 s window)")
    right.set_ylabel("trajectories / s", color="tab:orange")
    for s in steps:
        top.axvline(s["t"], color="tab:red", lw=0.6, alpha=0.5)
    top.set_xlabel("seconds since the job started (red: a step committed)")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"{title}: throughput and step time")
    if steps:
        n = [s["step"] for s in steps]
        bottom.bar(n, [s["step_s"] for s in steps], color="tab:red", alpha=0.7, label="train step")
        bottom.bar(
            n,
            [s["push_s"] for s in steps],
            bottom=[s["step_s"] for s in steps],
            color="tab:olive",
            alpha=0.7,
            label="weight push (in the background)",
        )
        bottom.set_xlabel("train step")
        bottom.set_ylabel("seconds")
        bottom.legend(fontsize=8, loc="upper right")  # "best" searches every point: slow on long runs
    else:
        bottom.text(0.5, 0.5, "no step committed yet", ha="center", va="center", transform=bottom.transAxes)
    return _save(plt, fig, out / "throughput.png")


def _tools(timeline: dict[str, Any], title: str, out: Path) -> Path | None:
    samples = timeline.get("samples") or []
    statuses = sorted({k for s in samples for k in s.get("tool_calls", {})})
    if len(samples) < 2 or not statuses:
        return None
    plt = _plt()
    ts = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.stackplot(
        ts,
        [[s.get("tool_calls", {}).get(k, 0) for s in samples] for k in statuses],
        labels=statuses,
        colors=[STATUS_COLORS.get(k, "tab:brown") for k in statuses],
        alpha=0.8,
    )
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("tool calls returned")
    ax.set_title(f"{title}: tool outcomes")
    ax.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, out / "tools.png")


MAX_ENGINE_LINES = 12
"""Engines drawn one line each; a larger fleet is drawn as its spread and its total (1,024 lines
and a legend of 1,024 names say nothing, and cost the watching command seconds of CPU a redraw)."""
FLEET_BINS = 240


def _fleet(by_engine: dict[str, list[dict[str, Any]]]) -> tuple[list[float], list[list[float]], list[float]]:
    """On a grid of FLEET_BINS times: each reporting engine's last utilisation (running over batch
    slots) and the fleet's tokens/s, each engine's last report carried forward (reports come on
    change, so an engine holds its state until its next one)."""
    end = max(xs[-1]["t"] for xs in by_engine.values())
    grid = [end * i / (FLEET_BINS - 1) for i in range(FLEET_BINS)]
    util: list[list[float]] = [[] for _ in grid]
    total = [0.0] * len(grid)
    for xs in by_engine.values():
        j, last = 0, None
        for i, t in enumerate(grid):
            while j < len(xs) and xs[j]["t"] <= t:
                last, j = xs[j], j + 1
            if last is not None:
                util[i].append(last["running"] / max(1, last["capacity"]))
                total[i] += last["tokens_per_s"]
    return grid, util, total


def _quantile(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def _engines(timeline: dict[str, Any], title: str, out: Path) -> Path | None:
    loads = timeline.get("engines") or []
    if not loads:
        return None
    plt = _plt()
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for x in sorted(loads, key=lambda x: x["t"]):
        by_engine.setdefault(x["engine"], []).append(x)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    if len(by_engine) <= MAX_ENGINE_LINES:
        for engine, xs in sorted(by_engine.items()):
            ts = [x["t"] for x in xs]
            top.step(ts, [x["running"] / max(1, x["capacity"]) for x in xs], where="post", label=engine)
            bottom.plot(ts, [x["tokens_per_s"] for x in xs], lw=1, label=engine)
        top.legend(fontsize=8, loc="upper right")
        bottom.set_ylabel("tokens / s")
    else:
        grid, util, total = _fleet(by_engine)
        kept = [(t, sorted(u)) for t, u in zip(grid, util, strict=True) if u]
        ts = [t for t, _ in kept]
        top.fill_between(
            ts,
            [_quantile(u, 0.1) for _, u in kept],
            [_quantile(u, 0.9) for _, u in kept],
            step="post",
            alpha=0.3,
            label="p10-p90 of engines",
        )
        top.step(ts, [sum(u) / len(u) for _, u in kept], where="post", label="mean")
        top.step(ts, [u[-1] for _, u in kept], where="post", lw=0.8, ls=":", label="busiest")
        top.legend(fontsize=8, loc="upper right", title=f"{len(by_engine)} engines", title_fontsize=8)
        bottom.step(grid, total, where="post", lw=1)
        bottom.set_ylabel("tokens / s, all engines")
    top.set_ylabel("running / batch slots")
    top.set_ylim(0, 1.05)
    top.set_title(f"{title}: engine utilisation")
    bottom.set_ylim(bottom=0)  # from zero: a steady rate must not read as a swing of 127.84-127.92
    bottom.set_xlabel("seconds since the job started")
    return _save(plt, fig, out / "engines.png")


def write_run_plots(timeline: dict[str, Any], title: str, out_dir: Path) -> list[Path]:
    """The PNGs the timeline has data for (none for a job that never started)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [f(timeline, title, out_dir) for f in (_throughput, _tools, _engines)]
    return [p for p in paths if p is not None]
