"""Lending the trainer's GPUs to rollout: what one move between the two costs."""

from __future__ import annotations

from services.common.runconfig import RunConfig


def switch_s(cfg: RunConfig) -> float:
    """Wall seconds one move of the training GPUs between training and rollout takes, each way.

    Emulated engines pay the cost model's colocated role switch (verl's: offload the training
    state, reshard the weights into the engine's TP, wake the engine; `colocated_switch_s`) over
    `training.emulated_gpus` at the lent engines' TP, in wall time (`time_scale`), as the
    simulator charges it. Real engines pay what the move really costs (0 here)."""
    if cfg.rollout.backend != "emulated" or cfg.planner.lending.engines == 0:
        return 0.0
    e = cfg.rollout.emulated
    cm = e.costs()
    switch = cm.colocated_switch_s(cfg.training.emulated_gpus, cfg.planner.lending.tensor_parallel)
    return switch * cfg.rollout.emulated.time_scale


def lent_share(cfg: RunConfig) -> float:
    """The lent engines' share of the GPUs serving rollout while they are lent (each engine counts
    its bucket's TP, each lent one the lent TP)."""
    lend = cfg.planner.lending
    lent = lend.engines * lend.tensor_parallel
    tp = {b.name: b.tensor_parallel for b in cfg.rollout.buckets}
    serving = sum(tp[name] * n for name, n in cfg.bucket_engines.items())
    return lent / (serving + lent) if lent else 0.0
