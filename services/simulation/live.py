"""The simulator on a live job's configuration: what `libra bench live` checks the live stack
against, and what the layout search (`tools/layout.py`) scores its proposals with.

A job's config maps onto one simulated system: its buckets (TP, engines, thresholds) and router,
its emulated training GPUs and TP, batch size, staleness, lending, the planner's re-fits (and
re-layouts) and the job's finite feed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from services.common.cost_model import CostModel
from services.common.runconfig import BucketConfig, RunConfig
from services.common.synthetic import Workload
from services.policy.replan import ReplanPolicy
from services.policy.routing import build_router
from services.policy.search import BucketPlan
from services.simulation.runner import run_system, steady_rate
from services.simulation.state import SystemConfig


def cost_model(cfg: RunConfig) -> CostModel:
    e = cfg.rollout.emulated
    return e.costs()


def bucket_plans(cfg: RunConfig) -> list[BucketPlan]:
    """The job's buckets as the simulator's plan has them (engines per bucket as the planner
    assigns them live)."""
    per = cfg.bucket_engines
    return [
        BucketPlan(b.name, b.tensor_parallel, per[b.name], float(b.max_output_tokens or math.inf))
        for b in cfg.rollout.buckets
    ]


def job_gpus(cfg: RunConfig) -> int:
    """GPUs the job stands for: its engines' (TP each) and its training GPUs (the lent engines run
    on those)."""
    return sum(b.gpus for b in bucket_plans(cfg)) + cfg.training.emulated_gpus


def system_for(
    cfg: RunConfig,
    steps: int | None = None,
    buckets: list[BucketPlan] | None = None,
    router_buckets: Sequence[BucketConfig] | None = None,
) -> SystemConfig:
    """The job as a simulated system (`steps`: a shorter job, e.g. for a quick estimate; `buckets`
    and `router_buckets`: another layout of its engines, as the planner's candidates are)."""
    r, t = cfg.rollout, cfg.training
    return SystemConfig(
        f"live-{r.policy}",
        "async",
        t.emulated_gpus,
        t.emulated_tp,
        buckets if buckets is not None else bucket_plans(cfg),
        build_router(router_buckets if router_buckets is not None else r.buckets, r.policy),
        staleness=t.max_staleness,
        max_seqs=r.max_batch,
        pooled_routing=r.policy == "least_loaded",
        update_mode="recompute",
        job_groups=(steps or t.steps) * t.groups_per_step,  # the live feed launches no more
        lend_tp=cfg.planner.lending.tensor_parallel if cfg.planner.lending.engines else 0,
        lend_policy=cfg.planner.lending.policy,
        replan=replan_policy(cfg),
        relayout=cfg.planner.relayout,
        push_share=push_share(cfg),
        push_copies=push_copies(cfg),
        trainer_on_host=cfg.training.backend != "emulated",  # a live job's trainer: on its host
    )


def push_share(cfg: RunConfig) -> float:
    """What a push after an engine's first carries live: nothing from an emulated trainer (it
    changes no weight) to real engines, which take deltas; emulated engines stall for a whole
    load whatever the trainer (services/generation/backends/emulated.py)."""
    real_engines = cfg.rollout.backend in ("vllm", "hf")
    return 0.0 if real_engines and cfg.training.backend == "emulated" else 1.0


def push_copies(cfg: RunConfig) -> int:
    """Copies of the weights the trainer uploads at once to the job's real engines: the roots of
    its relay tree (`training.push_fanout`; 0: every engine), each forwarding as it receives; an
    emulated engine stalls one load's time however it is pushed."""
    if cfg.rollout.backend not in ("vllm", "hf"):
        return 1
    engines = sum(cfg.bucket_engines.values())
    fanout = cfg.training.push_fanout
    return max(1, min(fanout, engines) if fanout else engines)


def replan_policy(cfg: RunConfig) -> ReplanPolicy | None:
    """The live planner's re-fit triggers in simulated seconds (its wall seconds over the emulated
    engines' `time_scale`), or None where the live planner does not re-fit (`planner.replan` off,
    one bucket, or routing that is not C-MLFQ)."""
    p, r = cfg.planner, cfg.rollout
    if not p.replan or r.policy != "cmlfq" or len(r.buckets) < 2:
        return None
    scale = r.emulated.time_scale
    return ReplanPolicy(interval_s=p.interval_s / scale, cooldown_s=p.cooldown_s / scale, min_gain=p.min_gain)


def job_workload(cfg: RunConfig, workload: Workload) -> Workload:
    return workload.with_overrides(
        max_context=cfg.task.max_context_tokens,
        group_size=cfg.task.group_size,
        prompts_per_step=cfg.training.groups_per_step,
    )


def simulate(cfg: RunConfig, workload: Workload, seed: int, steps: int | None = None) -> dict[str, Any]:
    """One simulated run of the job (its own steps unless `steps`), with `trajectories_per_s` the
    steady rate as the live job measures it, and its training steps' and pushes' seconds."""
    steps = steps or cfg.training.steps
    out, sim = run_system(
        system_for(cfg, steps), job_workload(cfg, workload), cost_model(cfg), job_gpus(cfg), steps, seed
    )
    out["trajectories_per_s"] = steady_rate(out["step_end_s"], cfg.trajectories_per_step, drained=True)
    out["train_step_s"], out["push_s"] = list(sim.training.durations), list(sim.training.pushes)
    return out
