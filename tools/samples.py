"""A job's rollout samples: its trajectories as text (the prompt, each turn, each tool call with its
arguments, status and what came back, the reward and the advantage it trained with), in
runs/<id>/samples.jsonl, and `libra samples [RUN] [--step N] [--worst|--best]` to read them.

The scheduler publishes each completed trajectory's text (`traj.sample`, best effort); `libra run`
holds them (up to HELD_BYTES) and, with the trainer's group outcomes, writes a bounded selection:
every group of the first and last trained steps, `job.samples_per_step` groups of each other step,
and that many groups that were not trained (failed, invalid, stale), so a failure is there to read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from services.common.contracts import ev
from services.common.runconfig import RunConfig
from services.learning.advantages import group_advantages

HELD_BYTES = 64 << 20
"""Text `libra run` holds for a job's samples; what comes after is counted, not kept."""


class SampleStore:
    """What `libra run` hears of a job's trajectories' text and its groups' outcomes."""

    def __init__(self, limit_bytes: int = HELD_BYTES):
        self.limit = limit_bytes
        self.held: dict[str, dict[str, Any]] = {}
        self.bytes = 0
        self.dropped = 0
        self.outcomes: dict[str, ev.GroupOutcome] = {}

    def add(self, s: ev.TrajectorySample) -> None:
        size = len(s.transcript_json)
        if s.trajectory_id in self.held:
            return
        if self.bytes + size > self.limit:
            self.dropped += 1
            return
        try:
            body = json.loads(s.transcript_json)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        self.bytes += size
        self.held[s.trajectory_id] = {"trajectory_id": s.trajectory_id, "group_id": s.group_id, **body}

    def outcome(self, o: ev.GroupOutcome) -> None:
        """A group's one outcome (a re-announced `trained` adds the ids it names)."""
        known = self.outcomes.get(o.group_id)
        if known is None:
            self.outcomes[o.group_id] = o
        elif known.outcome == o.outcome == "trained":
            known.trained_ids.extend(i for i in o.trained_ids if i not in known.trained_ids)


def select(store: SampleStore, cfg: RunConfig) -> list[dict[str, Any]]:
    """The samples to write, by step (untrained groups last), each with its group's outcome and,
    for trained groups, the advantage the trainer computed from the group's rewards."""
    per_step = cfg.job.samples_per_step
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in store.held.values():
        groups.setdefault(row["group_id"], []).append(row)
    trained = {g: o for g, o in store.outcomes.items() if o.outcome == "trained" and o.train_step > 0}
    steps = sorted({o.train_step for o in trained.values()})
    ends = {steps[0], steps[-1]} if steps else set()
    chosen: list[tuple[int, str]] = []
    for step in steps:
        gids = sorted(g for g, o in trained.items() if o.train_step == step and g in groups)
        chosen += [(step, g) for g in (gids if step in ends else gids[:per_step])]
    others = sorted(g for g, o in store.outcomes.items() if o.outcome != "trained" and g in groups)
    chosen += [(0, g) for g in others[:per_step]]
    out: list[dict[str, Any]] = []
    for step, gid in chosen:
        rows = sorted(groups[gid], key=lambda r: r["trajectory_id"])
        outcome = store.outcomes[gid]
        rewards = [float(r.get("reward") or 0.0) for r in rows]
        advantages = (
            group_advantages(rewards, [gid] * len(rows), estimator=cfg.training.advantage)
            if outcome.outcome == "trained"
            else [None] * len(rows)
        )
        for r, adv in zip(rows, advantages, strict=True):
            out.append(
                {
                    "step": step or None,
                    "outcome": outcome.outcome,
                    "outcome_reason": outcome.reason or None,
                    "advantage": round(adv, 4) if adv is not None else None,
                    **r,
                }
            )
    return out


def write(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def render(row: dict[str, Any]) -> str:
    """One sample as a reader wants it: who said what, each tool call and what came back."""
    step = f"step {row['step']}" if row.get("step") else str(row.get("outcome", "")).upper()
    adv = f", advantage {row['advantage']:+.3f}" if row.get("advantage") is not None else ""
    versions = row.get("policy_versions") or []
    policy = (
        f", policy v{versions[0]}" + (f"-{versions[-1]}" if versions[-1] != versions[0] else "")
        if versions
        else ""
    )
    head = (
        f"── {step} · group {row['group_id']} · {row['trajectory_id']} · reward {row.get('reward')}{adv}"
        f" · {row.get('finish')} after {row.get('turns')} turn(s){policy}"
    )
    lines = [head]
    if row.get("failure"):
        lines.append(f"   failed: {row['failure']}")
    if row.get("outcome_reason") and row.get("outcome") != "trained":
        lines.append(f"   group {row['outcome']}: {row['outcome_reason']}")
    for m in row.get("prompt") or []:
        lines.append(f"[{m.get('role')}] {m.get('content')}")
    if row.get("answer") is not None:
        lines.append(f"[reference answer] {row['answer']}")
    for e in row.get("events") or []:
        if e.get("role") == "assistant":
            lines.append(f"[assistant, {e.get('tokens')} tokens, {e.get('finish')}] {e.get('text')}")
        elif e.get("role") == "tool":
            args = json.dumps(e.get("args"), ensure_ascii=False)
            lines.append(f"[tool {e.get('tool')} {args} → {e.get('status')}] {e.get('returned')}")
        else:
            lines.append(f"[{e.get('role')}] {e.get('text')}")
    if row.get("events_dropped"):
        lines.append(f"   ({row['events_dropped']} later events left out: the sample's size bound)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.run_dirs import add_output_dir, find_run

    p = argparse.ArgumentParser(
        prog="libra samples", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("run", nargs="?", default="latest", help="run id (default: the last run)")
    p.add_argument("--step", type=int, help="only this train step's samples")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first (failed ones first of all)")
    order.add_argument("--best", action="store_true", help="highest reward first")
    p.add_argument("-n", type=int, default=10, help="how many to print (default 10)")
    add_output_dir(p)
    args = p.parse_args(argv)
    run_dir, looked = find_run(args.run, args.runs_dir, needs="samples.jsonl")
    if run_dir is None:
        where = ", ".join(str(d / "samples.jsonl") for d in looked)
        print(f"no samples for run {args.run!r} in {where} (`libra run` writes them)", file=sys.stderr)
        return 2
    rows = read(run_dir / "samples.jsonl")
    if args.step is not None:
        rows = [r for r in rows if r.get("step") == args.step]
    if args.worst or args.best:

        def key(r: dict[str, Any]) -> tuple[int, float]:
            failed = 0 if r.get("failure") else 1
            reward = float(r.get("reward") or 0.0)
            return (failed, reward) if args.worst else (-failed, -reward)

        rows = sorted(rows, key=key)
    for row in rows[: args.n]:
        print(render(row))
        print()
    print(f"{min(len(rows), args.n)} of {len(rows)} sample(s) from {run_dir / 'samples.jsonl'}")
    return 0
