"""The systems under test, built from the same cluster, model and workload.

Libra and its ablations get their allocation from the planner's search; the baselines get theirs
from a sweep in the simulator itself (the best fixed split and TP degree for each), so every
baseline runs at its best settings.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from services.planner.cost_model import CostModel
from services.planner.hybrid_pool import PoolPolicy
from services.planner.replan import ReplanPolicy
from services.planner.search import (
    BucketPlan,
    ClusterSpec,
    Plan,
    SearchOptions,
    WorkloadStats,
    best_layout,
    search,
    train_time,
)
from services.scheduler.cmlfq import CMLFQ, Bucket, CMLFQConfig
from tools.sim.routers import CMLFQRouter, StaticRouter
from tools.sim.simulator import Simulator, SystemConfig, workload_stats
from tools.sim.workload import Workload

BASELINES = ("colocated-sync", "disaggregated-static", "homogeneous-lb", "length-aware")
ABLATIONS = ("libra-no-ehp", "libra-no-grp", "libra-no-cmlfq")
SYSTEMS = ("libra", *BASELINES, *ABLATIONS)
LENGTH_PREDICTOR_SIGMA = 0.8
"""Lognormal error of the length-aware baseline's predictor (about 2.2x typical error)."""


@dataclass
class Env:
    cm: CostModel
    workload: Workload
    n_gpus: int
    seed: int = 0
    staleness: int = 1
    max_seqs: int = 128
    plan_steps: int = 4
    """Steps each planner proposal is simulated for; 0 trusts the analytical search alone."""

    def __post_init__(self) -> None:
        rng = random.Random(self.seed + 7919)
        specs = [
            s
            for g in range(min(4 * self.workload.prompts_per_step, 256))
            for s in self.workload.sample_group(rng, f"q{g}", 0)
        ]
        self.profile: WorkloadStats = workload_stats(self.workload, [], specs)

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(self.n_gpus, self.cm.gpu)

    def best_train_tp(self, gpus: int) -> int:
        opts = SearchOptions()
        tps = [tp for tp in (1, 2, 4, 8) if gpus % tp == 0]
        return min(tps, key=lambda tp: train_time(self.cm, self.profile, gpus, tp, opts))


def cmlfq_buckets(env: Env, buckets: list[BucketPlan]) -> list[Bucket]:
    """C-MLFQ buckets with each bucket's relative per-token time, which prices migrations."""
    ctx = env.profile.prompt_tokens + env.profile.context_per_output * env.profile.quantile(0.5)
    base = env.cm.decode_step_s(16, ctx, 1)
    return [Bucket(b.name, b.tp, b.max_tokens, env.cm.decode_step_s(16, ctx, b.tp) / base) for b in buckets]


def plan_for(env: Env, hybrid: bool = True, steps: int | None = None, routing: str = "cmlfq") -> Plan:
    """The planner's allocation, with the simulator as the final judge (Frontier-style what-if).

    The analytical search proposes allocations; a few are simulated for `steps` steps on the same
    workload and the fastest wins: first the training size (each with its best three-bucket
    layout), then, at that size, the bucket TP mix (TP1/2/4, 1/4, 2/4 or 4 alone), then a hybrid
    pool on top of the winner (see :func:`_hybrid_variants`).
    The analytical model alone mis-ranks allocations when rollout is latency-bound (a long tail,
    not throughput, sets the step time); measuring proposals is what a live planner does with its
    first steps, and the same budget the baselines' sweeps get. Proposals are measured with the
    routing the system will run (`routing`), so an ablation gets the allocation that suits it.
    """
    base = SearchOptions(
        max_seqs=env.max_seqs, hybrid=False, sync_s=env.cm.weight_sync_s(), staleness=env.staleness
    )
    steps = env.plan_steps if steps is None else steps
    if steps <= 0:
        opts = SearchOptions(
            max_seqs=env.max_seqs, hybrid=hybrid, sync_s=base.sync_s, staleness=env.staleness
        )
        return search(env.cluster, env.cm.model, env.profile, env.cm, opts)
    scored: list[tuple[float, Plan]] = []
    for tg in default_splits(env):
        plan = _propose(env, base, tg, 0, (1, 2, 4))
        if plan is not None:
            scored.append((measure(env, plan, steps, routing), plan))
    if not scored:
        raise ValueError(f"no feasible plan for {env.n_gpus} GPUs")
    best_score, best = max(scored, key=lambda x: x[0])
    tg = best.train_gpus
    for tps in ((1, 4), (2, 4), (4,)):
        plan = _propose(env, base, tg, 0, tps)
        if plan is not None:
            score = measure(env, plan, steps, routing)
            if score > best_score:
                best_score, best = score, plan
    if hybrid:
        for plan in _hybrid_variants(env, best):
            score = measure(env, plan, steps, routing)
            if score > best_score:
                best_score, best = score, plan
    return best


def _hybrid_variants(env: Env, plan: Plan) -> list[Plan]:
    """The best static plan plus a hybrid pool of TP1 workers taken from training (half a node or a
    node: training shrinks, the pool lends the GPUs back during steps) or from the first bucket's
    TP1 replicas (they serve rollout and train during steps)."""
    out = []
    half = env.cm.gpu.gpus_per_node // 2
    for h in (half, 2 * half):
        if plan.train_gpus - h >= env.cm.min_train_gpus():
            tg = plan.train_gpus - h
            out.append(Plan(tg, env.best_train_tp(tg), _copy(plan.buckets), h))
    first = plan.buckets[0]
    if first.tp == 1 and first.replicas >= 2:
        buckets = _copy(plan.buckets)
        h = buckets[0].replicas // 2
        buckets[0].replicas -= h
        out.append(Plan(plan.train_gpus, plan.train_tp, buckets, h))
    return out


def _copy(buckets: list[BucketPlan]) -> list[BucketPlan]:
    return [BucketPlan(b.name, b.tp, b.replicas, b.max_tokens) for b in buckets]


def _propose(env: Env, opts: SearchOptions, tg: int, h: int, tps: tuple[int, ...]) -> Plan | None:
    """The analytical best layout for tg training GPUs, h hybrid GPUs and bucket TP degrees tps."""
    o = SearchOptions(
        bucket_tps=tps,
        max_seqs=opts.max_seqs,
        hybrid=False,
        sync_s=opts.sync_s,
        staleness=opts.staleness,
        fixed_train_gpus=tg,
    )
    o.bucket_names = ("short", "medium", "long")[3 - len(tps) :] if len(tps) < 3 else o.bucket_names
    buckets, t_roll = best_layout(env.cm, env.profile, env.n_gpus - tg - h, o, hybrid=h)
    if not buckets:
        return None
    if h and tps[0] != 1:
        return None
    return Plan(tg, env.best_train_tp(tg), buckets, h, train_time(env.cm, env.profile, tg, 1, o), t_roll)


def default_splits(env: Env) -> list[int]:
    """Up to five training-GPU counts between the memory minimum and all but one node."""
    n = env.n_gpus
    unit = max(env.cm.gpu.gpus_per_node, n // 48 * 4)
    lo = math.ceil(env.cm.min_train_gpus() / unit) * unit
    cands = list(range(lo, n - unit + 1, unit))
    if len(cands) <= 5:
        return cands
    return sorted({cands[round(i * (len(cands) - 1) / 4)] for i in range(5)})


def measure(env: Env, plan: Plan, steps: int = 4, routing: str = "cmlfq") -> float:
    """Steady-state trajectories per second of a plan, simulated for a few steps."""
    system = _libra(env, "proposal", plan, routing=routing, replan=False)
    sim = Simulator(system, env.workload, env.cm, env.n_gpus, steps, env.seed)
    sim.run()
    ends = sim.step_ends
    if len(ends) < 2:
        return sum(sim.step_trajs) / max(1e-9, sim.now)
    return sum(sim.step_trajs[1:]) / (ends[-1] - ends[0])


def _libra(env: Env, name: str, plan: Plan, routing: str = "cmlfq", replan: bool = True) -> SystemConfig:
    buckets = [BucketPlan(b.name, b.tp, b.replicas, b.max_tokens) for b in plan.buckets]
    if routing == "cmlfq":
        router: object = CMLFQRouter(CMLFQ(CMLFQConfig(cmlfq_buckets(env, buckets))))
    else:
        router = StaticRouter([("all", math.inf)], mode="least", seed=env.seed)
    return SystemConfig(
        name=name,
        mode="async",
        train_gpus=plan.train_gpus,
        train_tp=plan.train_tp,
        buckets=buckets,
        router=router,
        hybrid_gpus=plan.hybrid_gpus,
        staleness=env.staleness,
        max_seqs=env.max_seqs,
        pool_policy=PoolPolicy(),
        replan=ReplanPolicy(interval_s=300.0, cooldown_s=120.0) if replan else None,
        pooled_routing=routing != "cmlfq",
        notes={"profile": env.profile, "plan": plan.to_dict()},
    )


def build(name: str, env: Env, split: int | None = None, tp: int | None = None) -> SystemConfig:
    """A system by name; `split` (training GPUs) and `tp` (rollout TP) pin a baseline's settings."""
    n = env.n_gpus
    if name == "libra":
        return _libra(env, name, plan_for(env))
    if name == "libra-no-ehp":
        return _libra(env, name, plan_for(env, hybrid=False))
    if name == "libra-no-cmlfq":
        return _libra(env, name, plan_for(env, routing="pooled"), routing="pooled")
    if name == "libra-no-grp":
        return _libra(env, name, _unplanned(env, split or n // 2), replan=False)
    if name == "colocated-sync":
        tp = tp or 1
        return SystemConfig(
            name,
            "sync",
            n,
            env.best_train_tp(n),
            [BucketPlan("all", tp, n // tp, math.inf)],
            StaticRouter([("all", math.inf)], seed=env.seed),
            max_seqs=env.max_seqs,
            notes={"rollout_tp": tp},
        )
    split = split or n // 2
    tp = tp or 1
    rollout = n - split
    if name in ("disaggregated-static", "homogeneous-lb"):
        mode = "rr" if name == "disaggregated-static" else "least"
        return SystemConfig(
            name,
            "async",
            split,
            env.best_train_tp(split),
            [BucketPlan("all", tp, rollout // tp, math.inf)],
            StaticRouter([("all", math.inf)], mode=mode, seed=env.seed, sticky=name == "homogeneous-lb"),
            staleness=env.staleness,
            max_seqs=env.max_seqs,
            notes={"split": split, "rollout_tp": tp},
        )
    if name == "length-aware":
        opts = SearchOptions(
            max_seqs=env.max_seqs, hybrid=False, fixed_train_gpus=split, staleness=env.staleness
        )
        plan = search(env.cluster, env.cm.model, env.profile, env.cm, opts)
        buckets = [BucketPlan(b.name, b.tp, b.replicas, b.max_tokens) for b in plan.buckets]
        router = StaticRouter(
            [(b.name, b.max_tokens) for b in buckets], predictor_sigma=LENGTH_PREDICTOR_SIGMA, seed=env.seed
        )
        return SystemConfig(
            name,
            "async",
            split,
            plan.train_tp,
            buckets,
            router,
            staleness=env.staleness,
            max_seqs=env.max_seqs,
            notes={"split": split, "plan": plan.to_dict()},
        )
    raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def _unplanned(env: Env, train_gpus: int) -> Plan:
    """Libra's mechanisms on an allocation made without the planner: the training split is swept
    like a baseline's (see :func:`tools.sim.scenarios.best_settings`), the rollout GPUs are shared
    equally by the TP1/TP2/TP4 buckets with thresholds at the median and P85 of a profiled
    length histogram, and an eighth of the rollout GPUs form the hybrid pool; no replanning."""
    rollout = env.n_gpus - train_gpus
    hybrid = rollout // 8 if rollout >= 16 else 0
    rest = rollout - hybrid
    per = rest // 3
    buckets = [
        BucketPlan("short", 1, per, env.profile.quantile(0.5)),
        BucketPlan("medium", 2, per // 2, env.profile.quantile(0.85)),
        BucketPlan("long", 4, max(1, per // 4), math.inf),
    ]
    buckets[0].replicas += rest - sum(b.gpus for b in buckets)
    if buckets[0].replicas < 1:
        raise ValueError(f"{rollout} rollout GPUs cannot hold three buckets")
    return Plan(train_gpus, env.best_train_tp(train_gpus), buckets, hybrid)
