"""The settings sweeps, Libra's planner proposals, and the multi-seed runs of a scenario
(:mod:`tools.sim.jobs` holds the scenarios and runs each simulation).

Settings are chosen on seeds from :data:`tools.sim.systems.PLAN_SEED` on; results are reported
on seeds 0..K-1, so no system is tuned on the trajectories it is judged on. Every simulation is
an independent job, run over a small process pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from services.common.synthetic import Workload
from services.policy.search import Plan, SearchOptions, search
from tools.sim.jobs import Job, Runner, Scenario, default_jobs
from tools.sim.stats import mean_ci, paired_ratio
from tools.sim.systems import (
    ALIASES,
    LIBRA_DRAFTER,
    LIBRA_SPECULATION,
    MIXES,
    PLAN_SEED,
    SD_DRAFT_TOKENS,
    SD_DRAFTERS,
    SD_LAYOUTS,
    SYSTEMS,
    TPS,
    Env,
    april_ratios,
    default_splits,
    hybrid_variants,
    plan_key,
    planner_menu,
    sweep_grid,
)

LIBRA_FAMILY = ("libra", "libra-no-ehp", "libra-no-cmlfq", "libra-no-sd", "libra-no-kvm")
LIBRA_SD: dict[str, Any] = {
    "drafter": LIBRA_DRAFTER,
    "spec_mode": LIBRA_SPECULATION.mode,
    "draft_tokens": LIBRA_SPECULATION.draft_tokens,
}
"""Settings of Libra's speculative decoding."""
LIBRA_TAIL: dict[str, Any] = {**LIBRA_SD, "kv_migration": True}
"""Libra's mechanisms against the tail: group-drafted speculation and KV migration."""
TAIL_OF: dict[str, dict[str, Any]] = {"libra-no-sd": {"kv_migration": True}, "libra-no-kvm": LIBRA_SD}
"""Tail mechanisms of the family members that leave one out (the rest have `LIBRA_TAIL`)."""


def _score(r: dict[str, Any]) -> float:
    return float(r["trajectories_per_s"])


def choose_settings(
    runner: Runner,
    names: Sequence[str],
    tick: Callable[[], None] | None = None,
    run_steps: int | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each system's settings, chosen by simulation on the planning seeds: candidates swept over
    `Scenario.sweep_steps`, the best few confirmed over the run's length (`run_steps`, default the
    scenario's). Returns the settings per system and the sweeps (every candidate with its score,
    the confirmed ones with their settings) for results.json."""
    env = runner.env
    steps = runner.scenario.sweep_steps
    confirm_steps = max(steps, run_steps or runner.scenario.steps)
    settings: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, Any] = {}
    if runner.scenario.plan_slice_gpus:
        return _choose_on_slice(runner, names, tick)
    if steps <= 0:
        for name in names:
            if name not in LIBRA_FAMILY:
                raise ValueError(f"{name}: a scenario without sweeps can only run Libra")
            plan = analytical_plan(env)
            settings[name] = {
                "plan": plan.to_dict(),
                "routing": "pooled" if name == "libra-no-cmlfq" else "cmlfq",
                **TAIL_OF.get(name, LIBRA_TAIL),
            }
            sweeps[name] = {"best": plan_key(plan), "grid": []}
        return settings, sweeps

    def measure(cands: list[tuple[str, dict[str, Any]]]) -> list[float]:
        jobs = [Job(n, s, PLAN_SEED, steps) for n, s in cands]
        return [_score(r) for r in runner.run_all(jobs, tick)]

    def confirm(name: str, rows: list[Proposal]) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
        """The last step of every system's choice: its `CONFIRM_TOP` best candidates measured over
        the run's length on the planning seed and `CONFIRM_SEEDS` more, the best mean kept. The
        length matters: a plan whose groups start to go stale late in a run leads a short sweep and
        loses the run (`python -m tools.sim.horizon`); more seeds keep one seed's luck from
        picking the settings."""
        top = _best(rows, CONFIRM_TOP)
        again = confirm_steps > steps
        seeds = [PLAN_SEED + k for k in range(0 if again else 1, CONFIRM_SEEDS + 1)]
        jobs = [Job(name, c, seed, confirm_steps) for seed in seeds for _, c, _ in top]
        outs = runner.run_all(jobs, tick)
        table: list[dict[str, Any]] = []
        means: list[float] = []
        for i, (first, c, key) in enumerate(top):
            runs = [outs[k * len(top) + i] for k in range(len(seeds))]
            scores = [_score(r) for r in runs] + ([] if again else [first])
            means.append(sum(scores) / len(scores))
            table.append(
                {
                    "settings": key,
                    "trajectories_per_s": means[-1],
                    "steps": confirm_steps,
                    "dropped_stale_groups": [int(r["dropped_stale_groups"]) for r in runs],
                    "candidate": c,
                }
            )
        best = max(range(len(top)), key=lambda i: means[i])
        return top[best][1], top[best][2], table

    layouts: dict[str, list[Proposal]] = {}
    for name in _sweep_order(names):
        if name in LIBRA_FAMILY:
            continue
        if name == "areal-sd":
            if "areal" not in layouts:
                raise ValueError("areal-sd needs areal's sweep")
            grid = drafter_grid(layouts["areal"])
        else:
            grid = [g for g in sweep_grid(name, env) if _feasible(runner, name, g)]
        if not grid:
            sweeps[name] = {
                "best": None,
                "grid": [],
                "infeasible": f"no feasible setting on {env.n_gpus} GPUs",
            }
            continue
        scores = measure([(name, g) for g in grid])
        rows = [(sc, g, _label(g)) for sc, g in zip(scores, grid, strict=True)]
        if name == "verl-apr":
            # slime's rollout is SGLang's, which offers speculative decoding as vLLM does.
            spec = drafter_grid(rows)
            rows += [
                (sc, g, _label(g)) for sc, g in zip(measure([(name, g) for g in spec]), spec, strict=True)
            ]
        rows = _with_more_seqs(name, rows, measure)
        layouts[name] = rows
        if name in names:
            chosen, key, confirmed = confirm(name, rows)
            settings[name] = chosen
            sweeps[name] = {
                "best": key,
                "grid": [{**g, "trajectories_per_s": sc} for sc, g, _ in rows],
                "confirmed": confirmed,
            }
    families: tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...] = (
        ("cmlfq", LIBRA_TAIL, ("libra", "libra-no-ehp")),
        ("pooled", LIBRA_TAIL, ("libra-no-cmlfq",)),
        ("cmlfq", TAIL_OF["libra-no-sd"], ("libra-no-sd",)),
        ("cmlfq", TAIL_OF["libra-no-kvm"], ("libra-no-kvm",)),
    )
    for routing, sd, family in families:
        wanted = [n for n in family if n in names]
        if not wanted:
            continue
        static, with_pool = plan_for(
            runner, routing, measure, hybrid=any(n != "libra-no-ehp" for n in wanted), extra=sd
        )
        for n in wanted:
            # The elastic pool works both ways: hybrid workers (rollout -> training) and lending
            # (training -> rollout); the no-EHP ablation gets neither.
            rows = [x for x in static if "lend_tp" not in x[1]] if n == "libra-no-ehp" else static + with_pool
            rows = _with_more_seqs(n, rows, measure)
            if routing == "cmlfq":
                rows = _with_pooled_routing(n, rows, measure)
            chosen, key, confirmed = confirm(n, rows)
            settings[n] = {k: v for k, v in chosen.items() if k != "replan"}
            sweeps[n] = {
                "best": key,
                "grid": [{"plan": k, "trajectories_per_s": sc} for sc, _, k in rows],
                "confirmed": confirmed,
            }
    return settings, sweeps


def _sweep_order(names: Sequence[str]) -> list[str]:
    """Baselines to sweep, `areal` first whenever `areal-sd` needs its layouts."""
    order = list(names)
    if "areal-sd" in order:
        order = ["areal", *[n for n in order if n != "areal"]]
    return order


def _best(rows: list[Proposal], n: int) -> list[Proposal]:
    """The `n` fastest candidates of a sweep, fastest first."""
    return sorted(rows, key=lambda x: -x[0])[:n]


def drafter_grid(rows: list[Proposal]) -> list[dict[str, Any]]:
    """Speculative decoding switched on after the layout, as an operator does: the best
    `SD_LAYOUTS` settings of a sweep, each with every drafter vLLM offers by one flag and every
    fixed draft length an operator tries."""
    top = _best(rows, SD_LAYOUTS)
    return [
        {**c, "drafter": d, "spec_mode": "fixed", "draft_tokens": k}
        for _, c, _ in top
        for d in SD_DRAFTERS
        for k in SD_DRAFT_TOKENS
    ]


CONFIRM_TOP = 3
CONFIRM_SEEDS = 2
"""Every system's three best candidates are measured again over the run's length, on the planning
seed and two more, before one is chosen (`choose_settings`)."""
MORE_SEQS = 256
"""The second `max_seqs` (vLLM's max_num_seqs) an operator tries on the best settings."""


def _with_top_changed(
    name: str,
    rows: list[Proposal],
    measure: Callable[[list[tuple[str, dict[str, Any]]]], list[float]],
    change: dict[str, Any],
) -> list[Proposal]:
    """`rows` plus a system's three best candidates measured again with `change` applied."""
    top = _best(rows, 3)
    changed = [{**c, **change} for _, c, _ in top]
    scores = measure([(name, c) for c in changed])
    return rows + [(sc, c, _label(c)) for sc, c in zip(scores, changed, strict=True)]


def _with_more_seqs(
    name: str, rows: list[Proposal], measure: Callable[[list[tuple[str, dict[str, Any]]]], list[float]]
) -> list[Proposal]:
    """Re-measure a system's three best candidates with `MORE_SEQS` turn slots per engine, as an
    operator tunes max_num_seqs after the layout; the same step for every system."""
    return _with_top_changed(name, rows, measure, {"max_seqs": MORE_SEQS})


def _with_pooled_routing(
    name: str, rows: list[Proposal], measure: Callable[[list[tuple[str, dict[str, Any]]]], list[float]]
) -> list[Proposal]:
    """The planner switching C-MLFQ off where it adds nothing: its three best proposals measured
    again with one pool routed least-connections (the `libra-no-cmlfq` routing), the faster kept."""
    return _with_top_changed(name, rows, measure, {"routing": "pooled"})


def _choose_on_slice(
    runner: Runner, names: Sequence[str], tick: Callable[[], None] | None
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Settings chosen by simulation on a slice of the cluster with the same trajectories per GPU,
    then every GPU count in them scaled to the whole cluster (rounding leftovers into training)."""
    sc = runner.scenario
    n, k = sc.n_gpus, sc.plan_slice_gpus
    prompts = max(1, round(runner.workload.prompts_per_step * k / n))
    small = dataclasses.replace(
        sc, n_gpus=k, prompts_per_step=prompts, sweep_steps=sc.slice_sweep_steps, plan_slice_gpus=0
    )
    settings, sweeps = choose_settings(Runner(small, runner.workload, runner.jobs), names, tick)
    scaled = {name: scale_settings(s, n / k, n) for name, s in settings.items()}
    for name in sweeps:
        sweeps[name]["slice"] = {"gpus": k, "prompts_per_step": prompts}
        if name in scaled:
            sweeps[name]["scaled_to"] = _label(scaled[name])
    return scaled, sweeps


def scale_settings(settings: dict[str, Any], factor: float, n_gpus: int) -> dict[str, Any]:
    """A slice's settings for a cluster `factor` times larger: training GPUs, bucket replicas and
    hybrid GPUs scale; TP degrees and routing do not; GPUs lost to rounding go to training."""
    out = dict(settings)
    if "split" in out:
        out["split"] = int(out["split"] * factor)
    if "plan" in out:
        plan = Plan.from_dict(out["plan"])
        for b in plan.buckets:
            b.replicas = max(1, round(b.replicas * factor))
        plan.hybrid_gpus = int(plan.hybrid_gpus * factor)
        plan.train_gpus = n_gpus - plan.rollout_gpus - plan.hybrid_gpus
        if plan.train_gpus < 1:
            raise ValueError(f"scaled plan {plan_key(plan)} leaves no GPU for training")
        out["plan"] = plan.to_dict()
    return out


def _label(settings: dict[str, Any]) -> str:
    """A readable name for a system's settings, as results.json and the table show it."""
    if "plan" in settings:
        label = plan_key(Plan.from_dict(settings["plan"]))
        if settings.get("lend_tp"):
            label += f"/lend-TP{settings['lend_tp']}"
    elif "colocated_tp" in settings:
        label = f"colocated/TP{settings['colocated_tp']}"
    elif "split" in settings:
        tps = settings.get("mix") or (settings.get("tp", 1),)
        label = f"train{settings['split']}/" + "+".join(f"TP{t}" for t in tps)
    else:
        label = f"colocated/TP{settings.get('tp', 1)}"
    if settings.get("partial"):
        label += f"/apr{settings['partial']:g}x"
    if settings.get("max_seqs"):
        label += f"/seqs{settings['max_seqs']}"
    if settings.get("kv_migration") and "colocated_tp" not in settings:
        label += "/kvm"  # a colocated plan has one engine per GPU group and nowhere to move KV
    if settings.get("routing") == "pooled":
        label += "/pooled"
    if settings.get("drafter", "none") != "none":
        label += f"/sd-{settings['drafter']}-{settings.get('spec_mode', 'adaptive')}{settings.get('draft_tokens', 8)}"
    return label


def _feasible(runner: Runner, name: str, settings: dict[str, Any]) -> bool:
    try:
        runner.build(Job(name, settings, PLAN_SEED, 1))
    except ValueError:
        return False
    return True


Proposal = tuple[float, dict[str, Any], str]
"""A scored proposal: throughput on the planning seed, the settings that build it, a label."""


def plan_for(
    runner: Runner,
    routing: str,
    measure: Callable[[list[tuple[str, dict[str, Any]]]], list[float]],
    hybrid: bool = True,
    extra: dict[str, Any] | None = None,
) -> tuple[list[Proposal], list[Proposal]]:
    """Libra's planner with the simulator as its judge (Frontier-style what-if).

    Proposals: every training split with every homogeneous TP (the whole menu of the homogeneous
    baselines), the analytical best layout of each heterogeneous TP mix, and time-sharing every
    GPU between the stages (colocated, at each TP) for regimes where training dominates, and
    homogeneous TP4/TP8 plans whose training GPUs serve rollout while the trainer waits for a
    batch (lending); then hybrid-pool variants of the two best disaggregated plans. Returns the scored static proposals
    and the scored hybrid ones.
    """
    env = runner.env
    menu = planner_menu(env)
    if not menu:
        raise ValueError(f"Libra's planner found no feasible allocation on {env.n_gpus} GPUs")
    sd = extra or {}
    cands: list[dict[str, Any]] = [
        {"plan": p.to_dict(), "routing": routing, "replan": False, **sd} for p, lend in menu if not lend
    ]
    cands += [
        {"colocated_tp": tp, "routing": routing, **sd, **({"partial": r} if r else {})}
        for tp in TPS
        if tp <= env.n_gpus
        for r in (0.0, *april_ratios(env))
    ]
    cands += [
        {"plan": p.to_dict(), "routing": routing, "replan": False, "lend_tp": lend, **sd}
        for p, lend in menu
        if lend
    ]
    static_scores = measure([("proposal", c) for c in cands])
    static = [(sc, c, _label(c)) for sc, c in zip(static_scores, cands, strict=True)]
    if not hybrid:
        return static, []
    top = sorted((x for x in static if "plan" in x[1] and "lend_tp" not in x[1]), key=lambda x: -x[0])[:2]
    variants = [
        {"plan": v.to_dict(), "routing": routing, **sd}
        for _, c, _ in top
        for v in hybrid_variants(env, Plan.from_dict(c["plan"]))
    ]
    scores = measure([("proposal", {**v, "replan": False}) for v in variants])
    return static, [(sc, v, _label(v)) for sc, v in zip(scores, variants, strict=True)]


def analytical_plan(env: Env) -> Plan:
    """The planner's analytical search alone (for clusters too large to simulate proposals)."""
    opts = SearchOptions(
        bucket_tps=(2, 4, 8),
        max_seqs=env.max_seqs,
        hybrid=False,
        sync_s=env.cm.weight_sync_s(),
        staleness=env.staleness,
    )
    return search(env.cluster, env.cm.model, env.profile, env.cm, opts)


def resolve(names: Sequence[str]) -> list[str]:
    out = [ALIASES.get(n, n) for n in names]
    unknown = [n for n in out if n not in SYSTEMS]
    if unknown:
        raise KeyError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(out))


def run(
    scenario: Scenario,
    seeds: int | None = None,
    steps: int | None = None,
    systems: Sequence[str] | None = None,
    workload: Workload | None = None,
    progress: Any = None,
    jobs: int | None = None,
) -> dict[str, Any]:
    names = resolve(systems or scenario.systems)
    seeds = seeds or scenario.seeds
    steps = steps or scenario.steps
    runner = Runner(scenario, workload, jobs or default_jobs())
    tick = progress.update if progress is not None else None
    settings, sweeps = choose_settings(runner, names, tick, run_steps=steps)
    infeasible = {n: sweeps[n]["infeasible"] for n in names if n not in settings}
    names = [n for n in names if n in settings]
    final = [Job(n, settings[n], seed, steps, timeline=seed == 0) for n in names for seed in range(seeds)]
    if progress is not None:
        progress.set_postfix_str("reported seeds")
    outs = runner.run_all(final, tick)
    per: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for job, r in zip(final, outs, strict=True):
        per[job.name].append(r)
    results: dict[str, Any] = {}
    for n, runs in per.items():
        tps = [r["trajectories_per_s"] for r in runs]
        mean, ci = mean_ci(tps)
        first = runs[0]
        results[n] = {
            **{k: v for k, v in first.items() if k not in ("trajectories_per_s", "trained_tokens_per_s")},
            "trajectories_per_s": mean,
            "ci95": list(ci),
            "trajectories_per_s_by_seed": tps,
            "trained_tokens_per_s": mean_ci([r["trained_tokens_per_s"] for r in runs])[0],
            # Dropping stale groups drops the longest ones: this shows how much shorter what a
            # system trains is than the workload (a system that trains every group has no bias).
            "trained_tokens_per_trajectory": mean_ci(
                [r["trained_tokens_per_s"] / r["trajectories_per_s"] for r in runs if r["trajectories_per_s"]]
            )[0],
            "trajectories_per_step": first["trajectories_trained"] / max(1, len(first["step_times_s"])),
            "max_staleness_trained": max(r["max_staleness_trained"] for r in runs),
            "trained_staleness_mean": mean_ci([r["trained_staleness_mean"] for r in runs])[0],
            "trained_token_staleness_mean": mean_ci([r["trained_token_staleness_mean"] for r in runs])[0],
            "dropped_stale_groups": [r["dropped_stale_groups"] for r in runs],
            "settings": sweeps[n].get("scaled_to", sweeps[n]["best"]),
        }
    ratios: dict[str, Any] = {}
    if "libra" in per:
        lib = [r["trajectories_per_s"] for r in per["libra"]]
        for n in names:
            if n != "libra":
                m, ci = paired_ratio(lib, [r["trajectories_per_s"] for r in per[n]])
                ratios[n] = {"mean": m, "ci95": list(ci)}
    return {
        "scenario": dataclasses.asdict(scenario) | {"steps": steps, "seeds": seeds, "systems": names},
        "reported_seeds": list(range(seeds)),
        "planning_seed": PLAN_SEED,
        "workload": runner.workload.name,
        "prompts_per_step": runner.workload.prompts_per_step,
        "group_size": runner.workload.group_size,
        "systems": results,
        "infeasible": infeasible,
        "ratios_vs_libra": ratios,
        "sweeps": sweeps,
    }


def sweep_size(runner_or_env: Any, names: Sequence[str]) -> int:
    """Jobs `choose_settings` will run (for a progress bar; the hybrid variants are estimated)."""
    env = runner_or_env.env if isinstance(runner_or_env, Runner) else runner_or_env
    if isinstance(runner_or_env, Runner):
        sc = runner_or_env.scenario
        if sc.sweep_steps <= 0 and not sc.plan_slice_gpus:
            return 0
    n = 0
    for name in _sweep_order(names):
        if name in LIBRA_FAMILY:
            continue
        with_sd = SD_LAYOUTS * len(SD_DRAFTERS) * len(SD_DRAFT_TOKENS)
        if name == "areal-sd":
            n += with_sd + 3
        else:
            n += len(sweep_grid(name, env)) + 3 + (with_sd if name == "verl-apr" else 0)
        n += CONFIRM_TOP * (CONFIRM_SEEDS + 1) if name in names else 0
    per_libra = (
        len(default_splits(env)) * (len(TPS) + len(MIXES) + 2)
        + len(TPS) * (1 + len(april_ratios(env)))
        + 10
        + CONFIRM_TOP * (CONFIRM_SEEDS + 1)
    )
    families = ("libra" in names or "libra-no-ehp" in names) + sum(
        n in names for n in ("libra-no-cmlfq", "libra-no-sd", "libra-no-kvm")
    )
    n += per_libra * families
    return n
