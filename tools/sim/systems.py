"""The systems under test, built from the same cluster, model and workload.

Every system's settings are chosen by simulating its candidates on seeds disjoint from the
reported ones (see :mod:`tools.sim.scenarios`): baselines sweep their training split and rollout
TP (1, 2, 4 and 8), Libra's planner simulates its own proposals, which include every homogeneous
layout a baseline could pick. So every baseline runs at its best settings, and Libra's choice is
never from a smaller menu than a baseline's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from services.common.cost_model import CostModel
from services.common.synthetic import Workload
from services.policy.cmlfq import CMLFQ, Bucket, CMLFQConfig
from services.policy.hybrid_pool import PoolPolicy
from services.policy.replan import ReplanPolicy
from services.policy.routing import CMLFQRouter, StaticRouter
from services.policy.search import (
    BucketPlan,
    ClusterSpec,
    Plan,
    SearchOptions,
    WorkloadStats,
    best_layout,
    train_time,
)
from services.policy.speculation import SpeculationPolicy
from services.simulation.drafting import AcceptanceModel
from services.simulation.replanning import workload_stats
from services.simulation.state import SystemConfig

BASELINES = (
    "verl",
    "verl-apr",
    "areal",
    "areal-sd",
    "areal-lend",
    "homogeneous-lb",
    "disaggregated-static",
    "length-aware",
)
ABLATIONS = ("libra-no-ehp", "libra-no-grp", "libra-no-cmlfq", "libra-no-sd", "libra-no-kvm")
SYSTEMS = ("libra", *BASELINES, *ABLATIONS)
ALIASES = {"colocated-sync": "verl"}
TPS = (1, 2, 4, 8)
MIXES = ((1, 4), (2, 8), (1, 2, 4), (2, 4, 8))
"""Heterogeneous bucket TP mixes a layout may use (short to long)."""
LENGTH_PREDICTOR_SIGMA = 0.8
"""Lognormal error of the length-aware baseline's predictor (about 2.2x typical error)."""
LIBRA_DRAFTER = "group"
LIBRA_SPECULATION = SpeculationPolicy("adaptive", 8)
"""Libra's engines draft from the whole GRPO group, at most 8 tokens (Seer's maximum, §4.1),
as many as pay for themselves at the engine's load."""
SD_DRAFTERS = ("ngram", "suffix")
"""What an AReaL operator can switch on in vLLM with one flag (`method: ngram | suffix`)."""
SD_DRAFT_TOKENS = (2, 4, 8)
"""`num_speculative_tokens` an operator tries."""
SD_LAYOUTS = 3
"""`areal-sd` tries speculation on `areal`'s best layouts, as an operator turns it on after the layout."""
APRIL_RATIOS = (1.5, 2.0, 3.0, 4.0)
"""Groups kept in flight per group trained that an operator of slime's partial rollout tries
(`--over-sampling-batch-size` over `--rollout-batch-size`: slime's examples use 1.25x-2x; 3x and
4x keep as many groups in flight as AReaL's bound does at η = 2 and 3)."""
PLAN_SEED = 10_000
"""Sweeps and planner proposals run on seeds from here on, disjoint from reported seeds."""


@dataclass
class Env:
    cm: CostModel
    workload: Workload
    n_gpus: int
    seed: int = 0
    staleness: int = 1
    max_seqs: int = 128
    acceptance_scale: float = 1.0
    """Multiplier on every drafter's extra accepted tokens (:class:`AcceptanceModel`)."""
    profile: WorkloadStats = field(init=False)

    def __post_init__(self) -> None:
        # The profile a planner (and an operator) has before the run: trajectories of other prompts.
        rng = random.Random(PLAN_SEED + 7919)
        specs = [
            s
            for g in range(min(4 * self.workload.prompts_per_step, 256))
            for s in self.workload.sample_group(rng, f"q{g}", 0)
        ]
        self.profile = workload_stats(self.workload, [], specs)
        self.max_seq = max(s.context_tokens for s in specs)

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(self.n_gpus, self.cm.gpu)

    def best_train_tp(self, gpus: int) -> int:
        opts = SearchOptions()
        tps = [tp for tp in TPS if gpus % tp == 0 and tp <= self.cm.gpu.gpus_per_node] or [1]
        return min(tps, key=lambda tp: train_time(self.cm, self.profile, gpus, tp, opts))

    @property
    def hybrid_tp(self) -> int:
        """A hybrid worker is one data-parallel training replica: TP x SP of the training layout."""
        return min(self.cm.gpu.gpus_per_node, self.cm.train_parallel(1, self.max_seq))


def cmlfq_buckets(env: Env, buckets: list[BucketPlan]) -> list[Bucket]:
    """C-MLFQ buckets with each bucket's relative per-token time, which prices migrations."""
    ctx = env.profile.prompt_tokens + env.profile.context_per_output * env.profile.quantile(0.5)
    base = env.cm.decode_step_s(16, ctx, 1)
    return [Bucket(b.name, b.tp, b.max_tokens, env.cm.decode_step_s(16, ctx, b.tp) / base) for b in buckets]


def default_splits(env: Env) -> list[int]:
    """Up to five training-GPU counts between the memory minimum and all but one rollout unit
    (a node on large clusters; on small ones, finer steps so that something is left for rollout)."""
    n = env.n_gpus
    need = env.cm.min_train_gpus()
    unit = max(env.cm.gpu.gpus_per_node, n // 48 * 4)
    while unit > 1 and math.ceil(need / unit) * unit > n - unit:
        unit //= 2
    lo = math.ceil(need / unit) * unit
    cands = list(range(lo, n - unit + 1, unit))
    if not cands:
        raise ValueError(
            f"{n} GPUs cannot hold training ({need} GPUs for {env.cm.model.name}'s sharded state) "
            "and a rollout engine; use more GPUs or a smaller model"
        )
    if len(cands) <= 5:
        return cands
    return sorted({cands[round(i * (len(cands) - 1) / 4)] for i in range(5)})


def homogeneous_plan(env: Env, split: int, tp: int, hybrid: int = 0) -> Plan | None:
    rollout = env.n_gpus - split - hybrid
    if rollout < tp or split < 1:
        return None
    used = rollout // tp * tp
    return Plan(
        split + rollout - used,
        env.best_train_tp(split),
        [BucketPlan("all", tp, rollout // tp, math.inf)],
        hybrid,
    )


def layout_plan(env: Env, split: int, tps: tuple[int, ...], hybrid: int = 0) -> Plan | None:
    """The analytical best bucket layout (thresholds, replicas) for one TP mix on the rollout GPUs."""
    if len(tps) == 1:
        return homogeneous_plan(env, split, tps[0], hybrid)
    names = (
        ("short", "medium", "long")[3 - len(tps) :]
        if len(tps) <= 3
        else tuple(f"b{i}" for i in range(len(tps)))
    )
    opts = SearchOptions(
        bucket_tps=tps,
        bucket_names=names,
        max_seqs=env.max_seqs,
        hybrid=False,
        sync_s=env.cm.weight_sync_s(),
        staleness=env.staleness,
        fixed_train_gpus=split,
    )
    buckets, t_roll = best_layout(env.cm, env.profile, env.n_gpus - split - hybrid, opts)
    if not buckets:
        return None
    spare = env.n_gpus - split - hybrid - sum(b.gpus for b in buckets)
    return Plan(split + spare, env.best_train_tp(split), buckets, hybrid, 0.0, t_roll)


def planner_menu(env: Env, homogeneous: bool = False) -> list[tuple[Plan, int]]:
    """The layouts Libra's planner proposes, each with the TP its training GPUs are lent at (0:
    not lent): every training split with every homogeneous TP and TP mix at the analytical best
    layout, and the homogeneous TP4/TP8 plans again with their training GPUs lent as engines of
    that TP. `homogeneous`: one bucket of one TP and no lending (what an operator tunes an
    AReaL-style split over)."""
    out: list[tuple[Plan, int]] = []
    for split in default_splits(env):
        for tps in [(tp,) for tp in TPS] + ([] if homogeneous else list(MIXES)):
            plan = layout_plan(env, split, tps)
            if plan is None or any(b.replicas < 1 for b in plan.buckets):
                continue
            out.append((plan, 0))
            tp = plan.buckets[0].tp
            if not homogeneous and len(plan.buckets) == 1 and tp >= 4 and plan.train_gpus % tp == 0:
                out.append((plan, tp))
    return out


def hybrid_variants(env: Env, plan: Plan) -> list[Plan]:
    """The plan with one or two hybrid workers (each a training replica of `env.hybrid_tp` GPUs)
    taken from training: training shrinks, the workers serve rollout and lend GPUs back to training
    while their bucket is quiet."""
    out = []
    unit = env.hybrid_tp
    for k in (1, 2):
        tg = plan.train_gpus - k * unit
        if tg >= env.cm.min_train_gpus():
            out.append(Plan(tg, env.best_train_tp(tg), _copy(plan.buckets), k * unit))
    return out


def _copy(buckets: list[BucketPlan]) -> list[BucketPlan]:
    return [BucketPlan(b.name, b.tp, b.replicas, b.max_tokens) for b in buckets]


def plan_key(plan: Plan) -> str:
    layout = "+".join(f"{b.replicas}xTP{b.tp}" for b in plan.buckets)
    return f"train{plan.train_gpus}/{layout}/hybrid{plan.hybrid_gpus}"


def libra_router(env: Env, buckets: list[BucketPlan], routing: str) -> Any:
    """C-MLFQ over the plan's buckets, or (the no-C-MLFQ ablation) least-connections over one pool."""
    if routing == "cmlfq":
        return CMLFQRouter(CMLFQ(CMLFQConfig(cmlfq_buckets(env, buckets))))
    return StaticRouter([("all", math.inf)], mode="least", seed=env.seed)


def speculation_for(settings: dict[str, Any]) -> tuple[str, SpeculationPolicy]:
    """The drafter and speculation policy a system's settings name (`drafter`, `spec_mode`,
    `draft_tokens`); none when the settings name no drafter."""
    drafter = str(settings.get("drafter", "none"))
    if drafter == "none":
        return drafter, SpeculationPolicy("off")
    return drafter, SpeculationPolicy(
        str(settings.get("spec_mode", "adaptive")), int(settings.get("draft_tokens", 8))
    )


def libra_system(
    env: Env,
    name: str,
    plan: Plan,
    routing: str = "cmlfq",
    replan: bool = True,
    lend_tp: int = 0,
    drafter: str = "none",
    speculation: SpeculationPolicy | None = None,
    kv_migration: bool = False,
    relayout: bool = False,
) -> SystemConfig:
    buckets = _copy(plan.buckets)
    router = libra_router(env, buckets, routing)
    return SystemConfig(
        name=name,
        mode="async",
        train_gpus=plan.train_gpus,
        train_tp=plan.train_tp,
        buckets=buckets,
        router=router,
        hybrid_gpus=plan.hybrid_gpus,
        hybrid_tp=env.hybrid_tp,
        staleness=env.staleness,
        max_seqs=env.max_seqs,
        acceptance=AcceptanceModel(env.acceptance_scale),
        pool_policy=PoolPolicy(),
        replan=ReplanPolicy(interval_s=300.0, cooldown_s=120.0) if replan and len(buckets) > 1 else None,
        relayout=relayout,
        pooled_routing=routing != "cmlfq",
        update_mode="recompute",
        lend_tp=lend_tp,
        drafter=drafter,
        speculation=speculation or SpeculationPolicy("off"),
        kv_migration=kv_migration,
        notes={
            "profile": env.profile,
            "plan": plan.to_dict(),
            "layout": plan_key(plan) + (f"/lend-TP{lend_tp}" if lend_tp else ""),
        },
    )


def libra_colocated(
    env: Env,
    name: str,
    tp: int,
    routing: str = "cmlfq",
    drafter: str = "none",
    speculation: SpeculationPolicy | None = None,
    partial: float = 0.0,
) -> SystemConfig:
    """Libra's planner choosing to time-share every GPU between the stages (the colocated plan):
    the same switch costs as `verl`, Libra's routing inside the rollout phase, and APRIL's partial
    rollout when `partial` (the over-provision ratio) is set."""
    n = env.n_gpus
    buckets = [BucketPlan("all", tp, n // tp, math.inf)]
    router = libra_router(env, buckets, routing)
    return SystemConfig(
        name,
        "sync",
        n,
        env.best_train_tp(n),
        buckets,
        router,
        max_seqs=env.max_seqs,
        acceptance=AcceptanceModel(env.acceptance_scale),
        drafter=drafter,
        speculation=speculation or SpeculationPolicy("off"),
        staleness=env.staleness,
        partial_rollout=partial,
        notes={"layout": f"colocated/TP{tp}", "rollout_tp": tp},
    )


def baseline_system(
    env: Env,
    name: str,
    split: int = 0,
    tp: int = 1,
    mix: tuple[int, ...] = (),
    drafter: str = "none",
    speculation: SpeculationPolicy | None = None,
    partial: float = 0.0,
) -> SystemConfig:
    """A baseline at pinned settings: `split` training GPUs, rollout `tp` (or TP `mix` for layouts);
    `areal-sd` with a drafter and a fixed draft length, `areal-lend` lending its training GPUs to
    rollout as TP-`tp` engines while the trainer waits for a batch, `verl-apr` keeping `partial`
    times the batch in flight (APRIL)."""
    n = env.n_gpus
    if name in ("verl", "verl-apr"):
        if (name == "verl-apr") != (partial > 0):
            raise ValueError(
                f"{name}: partial rollout's over-provision ratio is for verl-apr only, got {partial}"
            )
        return SystemConfig(
            name,
            "sync",
            n,
            env.best_train_tp(n),
            [BucketPlan("all", tp, n // tp, math.inf)],
            StaticRouter([("all", math.inf)], seed=env.seed),
            max_seqs=env.max_seqs,
            acceptance=AcceptanceModel(env.acceptance_scale),
            staleness=env.staleness,
            partial_rollout=partial,
            drafter=drafter,
            speculation=speculation or SpeculationPolicy("off"),
            notes={"rollout_tp": tp},
        )
    if name in ("areal", "areal-sd", "areal-lend", "homogeneous-lb", "disaggregated-static"):
        plan = homogeneous_plan(env, split, tp)
        if plan is None:
            raise ValueError(f"{name}: no layout for split {split}, TP {tp}")
        if name == "areal-sd" and (drafter not in SD_DRAFTERS or speculation is None):
            raise ValueError(f"{name}: needs a drafter ({', '.join(SD_DRAFTERS)}) and a draft length")
        if name == "areal-lend" and (tp < 4 or plan.train_gpus % tp):
            raise ValueError(f"{name}: {plan.train_gpus} training GPUs cannot lend TP{tp} engines")
        return SystemConfig(
            name,
            "async",
            plan.train_gpus,
            plan.train_tp,
            plan.buckets,
            StaticRouter(
                [("all", math.inf)], mode="rr" if name == "disaggregated-static" else "least", seed=env.seed
            ),
            staleness=env.staleness,
            max_seqs=env.max_seqs,
            acceptance=AcceptanceModel(env.acceptance_scale),
            update_mode="recompute" if name.startswith("areal") else "drain",
            lend_tp=tp if name == "areal-lend" else 0,
            drafter=drafter if name == "areal-sd" else "none",
            speculation=speculation if name == "areal-sd" and speculation else SpeculationPolicy("off"),
            notes={"split": split, "rollout_tp": tp},
        )
    if name == "length-aware":
        plan = layout_plan(env, split, mix)
        if plan is None:
            raise ValueError(f"{name}: no layout for split {split}, TPs {mix}")
        router = StaticRouter(
            [(b.name, b.max_tokens) for b in plan.buckets],
            predictor_sigma=LENGTH_PREDICTOR_SIGMA,
            seed=env.seed,
        )
        return SystemConfig(
            name,
            "async",
            plan.train_gpus,
            plan.train_tp,
            plan.buckets,
            router,
            staleness=env.staleness,
            max_seqs=env.max_seqs,
            acceptance=AcceptanceModel(env.acceptance_scale),
            update_mode="drain",
            notes={"split": split, "mix": list(mix), "layout": plan_key(plan)},
        )
    if name == "libra-no-grp":
        plan = layout_plan(env, split, mix)
        if plan is None:
            raise ValueError(f"{name}: no layout for split {split}, TPs {mix}")
        # Everything Libra has but the planner's layout, so the ablation isolates the layout.
        return libra_system(
            env,
            name,
            plan,
            replan=False,
            drafter=LIBRA_DRAFTER,
            speculation=LIBRA_SPECULATION,
            kv_migration=True,
        )
    raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def april_ratios(env: Env) -> list[float]:
    """The over-provision ratios worth trying under the bound: more than (η + 1) groups in flight
    per group trained is never admitted (AReaL's rule, which partial rollout follows too)."""
    return [r for r in APRIL_RATIOS if r <= env.staleness + 1]


def sweep_grid(name: str, env: Env) -> list[dict[str, Any]]:
    """The settings a skilled operator would try for a baseline."""
    splits = default_splits(env)
    if name == "verl":
        return [{"tp": tp} for tp in TPS]
    if name == "verl-apr":
        return [{"tp": tp, "partial": r} for tp in TPS for r in april_ratios(env)]
    if name in ("areal", "homogeneous-lb", "disaggregated-static"):
        return [{"split": s, "tp": tp} for s in splits for tp in TPS]
    if name == "areal-lend":
        # Libra's own lending menu (`plan_for`): TP4/TP8 engines on the training GPUs.
        return [{"split": s, "tp": tp} for s in splits for tp in TPS if tp >= 4 and s % tp == 0]
    if name in ("length-aware", "libra-no-grp"):
        return [{"split": s, "mix": m} for s in splits for m in MIXES]
    return []
