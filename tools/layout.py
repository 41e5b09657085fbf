"""The job's layout chosen from its workload before it starts (`planner.layout.search`).

The simulator's planner proposes (`plan_for`'s menu: every training split with every homogeneous
TP and TP mix of the buckets at its analytical best thresholds and replicas, and the homogeneous
TP4/TP8 plans whose training GPUs are lent to rollout while the trainer waits); each proposal is
written as this job's config and simulated as the job (`services/simulation/live.py`, what `libra bench live`
checks the live stack against) on one seed, the best few and the config's own layout again over
`seeds` seeds; the best mean wins if it beats the config's own by `min_gain`. The job then runs
with that layout, and its report says what was chosen and what the judge predicted.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from services.common.config import ConfigFileError
from services.common.runconfig import RunConfig
from services.common.synthetic import Workload
from services.policy.search import Plan
from services.simulation.live import bucket_plans, cost_model, job_gpus, job_workload, simulate
from tools.sim.stats import mean_ci
from tools.sim.systems import Env, plan_key, planner_menu

FINALISTS = 3
"""Proposals besides the config's own that are compared over several seeds."""


@dataclass
class Proposal:
    label: str
    cfg: RunConfig
    score: float = 0.0
    """Trajectories/s on the planning seed."""
    per_seed: list[float] | None = None

    @property
    def mean(self) -> float:
        return sum(self.per_seed) / len(self.per_seed) if self.per_seed else self.score


def label(cfg: RunConfig) -> str:
    t = cfg.training
    out = plan_key(Plan(t.emulated_gpus, t.emulated_tp, bucket_plans(cfg))).removesuffix("/hybrid0")
    lend = cfg.planner.lending
    return out + (f"/lend{lend.engines}xTP{lend.tensor_parallel}" if lend.engines else "")


def with_plan(cfg: RunConfig, plan: Plan, lend_tp: int = 0) -> RunConfig:
    """`cfg` with the plan's layout: its training GPUs and TP, its buckets (TP, engines, thresholds)
    and, with `lend_tp`, its training GPUs lent as engines of that TP."""
    data = cfg.model_dump(mode="json")
    context = max(b.max_context_tokens for b in cfg.rollout.buckets)
    data["rollout"]["engines"] = sum(b.replicas for b in plan.buckets)
    data["rollout"]["buckets"] = [
        {
            "name": b.name,
            "tensor_parallel": b.tp,
            "engines": b.replicas,
            "max_context_tokens": context,
            "max_output_tokens": None if math.isinf(b.max_tokens) else max(1, math.ceil(b.max_tokens)),
        }
        for b in plan.buckets
    ]
    data["training"]["emulated_gpus"] = plan.train_gpus
    data["training"]["emulated_tp"] = plan.train_tp
    lending = data["planner"]["lending"]
    lending.update(engines=plan.train_gpus // lend_tp if lend_tp else 0, bucket="")
    if lend_tp:
        lending["tensor_parallel"] = lend_tp
    data["planner"]["layout"]["search"] = False  # the chosen layout is a plain config
    return RunConfig.model_validate(data)


def proposals(
    cfg: RunConfig, workload: Workload, gpus: int, homogeneous: bool = False
) -> tuple[list[Proposal], list[str]]:
    """Every layout the simulator's planner would try on `gpus` GPUs, as this job's config; and
    why the others were left out (a proposal needing more engines than `max_engines`, or one the
    config refuses). `homogeneous`: only one bucket of one TP and no lending — the menu an
    operator tunes an AReaL-style split over (the benchmark's baseline)."""
    t, r = cfg.training, cfg.rollout
    env = Env(cost_model(cfg), job_workload(cfg, workload), gpus, cfg.task.seed, t.max_staleness, r.max_batch)
    try:
        plans = planner_menu(env, homogeneous)
    except ValueError as e:  # too few GPUs for the model's training state and one engine
        raise ConfigFileError(f"planner.layout: {e}") from None
    out: list[Proposal] = []
    left: list[str] = []
    seen: set[str] = set()
    for plan, lend_tp in plans:
        try:
            c = with_plan(cfg, plan, lend_tp)
        except ValidationError as e:
            left.append(f"{plan_key(plan)}: {e.errors()[0]['msg']}")
            continue
        name = label(c)
        if name in seen:
            continue
        seen.add(name)
        if c.engines_needed > cfg.planner.layout.max_engines:
            left.append(f"{name}: {c.engines_needed} engines > max_engines {cfg.planner.layout.max_engines}")
            continue
        out.append(Proposal(name, c))
    return out, left


def choose_layout(
    cfg: RunConfig, workload: Workload | None = None, progress: bool = True, homogeneous: bool = False
) -> tuple[RunConfig, dict[str, Any]]:
    """The config to run and the decision (what was searched, the finalists over seeds, what was
    chosen and its predicted gain over the config's own layout). `homogeneous`: over the tuned
    operator's menu only (`proposals`)."""
    lay = cfg.planner.layout
    if workload is None:
        assert cfg.task.workload is not None  # a synthetic task has one (RunConfig checks)
        workload = Workload.load(cfg.task.workload)
    gpus = lay.gpus or job_gpus(cfg)
    # the config's own layout, to compare with (unless it is for other GPUs)
    own = Proposal(label(cfg) + " (config)", cfg) if job_gpus(cfg) == gpus else None
    steps = min(lay.steps, cfg.training.steps) if cfg.training.steps >= 3 else lay.steps
    t0 = time.monotonic()
    props, left = proposals(cfg, workload, gpus, homogeneous)
    queue = ([own] if own else []) + props
    scored: list[Proposal] = []
    bar = _bar(len(queue) + FINALISTS * lay.seeds + lay.seeds, progress)
    for p in queue:
        if time.monotonic() - t0 > lay.budget_s and scored:
            left.append(f"{p.label}: not scored within budget_s {lay.budget_s:g}")
            continue
        p.score = simulate(p.cfg, workload, cfg.task.seed, steps)["trajectories_per_s"]
        scored.append(p)
        bar.update(1)
    ranked = sorted((p for p in scored if p is not own), key=lambda p: -p.score)
    finalists = ranked[:FINALISTS] + ([own] if own else [])
    if not finalists:
        raise ConfigFileError(
            f"planner.layout: no layout of {gpus} GPUs to choose from; "
            + "; ".join(left or ["none proposed"])
        )
    for p in finalists:
        p.per_seed = [p.score] + [
            simulate(p.cfg, workload, seed, steps)["trajectories_per_s"]
            for seed in range(cfg.task.seed + 1, cfg.task.seed + lay.seeds)
        ]
        bar.update(lay.seeds)
    bar.close()
    best = max(finalists, key=lambda p: p.mean)
    if own is not None and best is not own and best.mean < own.mean * (1 + lay.min_gain):
        best = own
    if best is own:
        chosen_cfg = cfg.model_copy(deep=True)
        chosen_cfg.planner.layout.search = False
    else:
        chosen_cfg = best.cfg
    decision = {
        "gpus": gpus,
        "steps_simulated": steps,
        "seeds": lay.seeds,
        "proposals": len(queue),
        "scored": len(scored),
        "left_out": left,
        "seconds": round(time.monotonic() - t0, 1),
        "finalists": [_row(p) for p in sorted(finalists, key=lambda p: -p.mean)],
        "chosen": best.label,
        "engines": chosen_cfg.engines_needed,
        "predicted_trajectories_per_s": best.mean,
        "config": _row(own) if own else None,
        "predicted_gain": best.mean / own.mean - 1 if own and own.mean > 0 else None,
        "predicted_gain_ci95": _paired_gain(best, own),
    }
    return chosen_cfg, decision


def _paired_gain(best: Proposal, own: Proposal | None) -> list[float] | None:
    """The 95 % CI of the per-seed gains over the config's own layout (the same seeds: paired)."""
    if own is None or best is own or not (best.per_seed and own.per_seed) or min(own.per_seed) <= 0:
        return None
    _, ci = mean_ci([a / b - 1 for a, b in zip(best.per_seed, own.per_seed, strict=True)])
    return list(ci)


def _row(p: Proposal) -> dict[str, Any]:
    m, ci = mean_ci(p.per_seed or [p.score])
    return {"label": p.label, "trajectories_per_s": m, "ci95": list(ci), "per_seed": p.per_seed}


def _bar(total: int, on: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="layout search", unit="sim", file=sys.stderr, disable=not on)


def summary(decision: dict[str, Any]) -> str:
    """The decision as `libra plan` and `libra run` print it."""
    lines = [
        f"layout search on {decision['gpus']} GPUs: {decision['scored']} of {decision['proposals']} "
        f"proposals simulated ({decision['steps_simulated']} steps; the best over {decision['seeds']} seeds) "
        f"in {decision['seconds']:.0f} s"
    ]
    for row in decision["finalists"]:
        lo, hi = row["ci95"]
        mark = (
            "*"
            if row["label"].removesuffix(" (config)") == decision["chosen"].removesuffix(" (config)")
            else " "
        )
        lines.append(f" {mark} {row['trajectories_per_s']:.3f} traj/s [{lo:.3f}, {hi:.3f}]  {row['label']}")
    gain = decision["predicted_gain"]
    lines.append(
        f"chosen: {decision['chosen']} ({decision['engines']} engines)"
        + (f", predicted {gain:+.1%} over the config's layout" if gain is not None else "")
        + (
            f" (paired 95 % CI [{decision['predicted_gain_ci95'][0]:+.1%}, {decision['predicted_gain_ci95'][1]:+.1%}])"
            if decision["predicted_gain_ci95"]
            else ""
        )
    )
    return "\n".join(lines)
