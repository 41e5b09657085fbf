"""The job's report (runs/<id>/report.json): what `libra run` observed of the job, and the facts the
services own — the trainer's fenced commit record, the scheduler's ledger (its accounting and
evaluation rounds), the planner's plans and role history, each engine's version asked over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev, ws, ws_grpc
from services.common.facts import read_facts
from services.common.grpc_auth import bearer_metadata
from services.common.membership import LENT_ROLE, PARKED_ROLE, SERVING_ROLES, SPARE_ROLE
from services.common.runconfig import (
    OWN_DATASETS,
    DatasetFile,
    HubDataset,
    ReasoningGymDataset,
    RunConfig,
    TaskConfig,
    VerifiersDataset,
)
from tools.job_watch import JobObserver, speculation_report
from tools.learning_plot import write_reward_plot
from tools.run_dirs import remember_runs_dir
from tools.run_plots import write_run_plots
from tools.sim.stats import t95

if TYPE_CHECKING:
    from services.common.tls import TlsFiles
from tools.stack import Stack


class JobFacts:
    """The facts the services own for one job, as they published them (services/common/facts.py):
    the trainer's commit record, the scheduler's ledger, the planner's plan and role history, and
    the planner's last plan (its PLAN stream). `libra run` reads none of their Redis keys."""

    def __init__(self, bus: Bus, run_id: str, cfg: RunConfig):
        self.bus, self.run_id, self.cfg = bus, run_id, cfg

    async def committed(self) -> ev.TrainerFacts | None:
        """The trainer's last committed step (an empty record before the first; None: unreadable)."""
        with contextlib.suppress(Exception):
            return await read_facts(self.bus, subjects.FACTS_TRAINER, ev.TrainerFacts) or ev.TrainerFacts()
        return None

    async def ledger(self) -> ev.SchedulerFacts:
        """The scheduler's ledger: its accounting and evaluation rounds (`error` says why not)."""
        try:
            facts = await read_facts(self.bus, subjects.FACTS_SCHEDULER, ev.SchedulerFacts)
        except Exception as err:  # NATS away: the report still gets written, saying so
            return ev.SchedulerFacts(error=f"{type(err).__name__}: {err}")
        return facts if facts is not None else ev.SchedulerFacts(error="the scheduler published none")

    async def settled_ledger(self, trained: int, wait_s: float = 5.0) -> ev.SchedulerFacts:
        """The ledger once it has heard of the `trained` trajectories the trainer committed (the
        last step's outcomes reach the scheduler a tick after the commit), or as it stands after
        `wait_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            facts = await self.ledger()
            if (not facts.error and facts.trained >= trained) or loop.time() >= deadline:
                return facts
            await asyncio.sleep(0.25)

    async def eval_rounds(self, facts: ev.SchedulerFacts | None = None) -> dict[int, dict[str, Any]]:
        """The finished evaluation rounds, by policy version."""
        facts = facts if facts is not None else await self.ledger()
        return {int(v): json.loads(summary) for v, summary in facts.eval_rounds.items()}

    async def evaluated(self) -> bool:
        """The final policy's evaluation is in (or none is configured)."""
        if self.cfg.eval.every <= 0:
            return True
        with contextlib.suppress(Exception):
            return self.cfg.training.steps in await self.eval_rounds()
        return False

    async def last_plan(self) -> ev.Plan | None:
        with contextlib.suppress(Exception):
            return await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
        return None

    async def buckets(self) -> list[dict[str, Any]]:
        """The rollout buckets of the job's last plan, with the engines assigned to each."""
        with contextlib.suppress(Exception):
            plan = await self.last_plan()
            if plan is not None:
                return [
                    {
                        "name": b.name,
                        "tensor_parallel": b.tensor_parallel,
                        "max_context_tokens": b.max_context_tokens,
                        "engines": sorted(
                            a.worker_id
                            for a in plan.assignments
                            if a.role == "rollout" and a.bucket == b.name
                        ),
                    }
                    for b in plan.buckets
                ]
        return []

    async def history(
        self,
    ) -> tuple[list[dict[str, Any]] | dict[str, str], list[dict[str, Any]] | dict[str, str]]:
        """The planner's plans and role changes (the most recent ones it keeps), or why not."""
        try:
            facts = await read_facts(self.bus, subjects.FACTS_PLANNER, ev.PlannerFacts)
        except Exception as err:  # NATS away: the report says so
            error = {"error": f"the planner's history could not be read: {type(err).__name__}: {err}"}
            return error, error
        facts = facts or ev.PlannerFacts()
        return [json.loads(x) for x in facts.plans], role_changes([json.loads(x) for x in facts.role_changes])


def eval_report(cfg: RunConfig, ledger: ev.SchedulerFacts) -> list[dict[str, Any]] | None:
    """Every evaluation round, by version (None when `eval` is off)."""
    if cfg.eval.every <= 0:
        return None
    if ledger.error:
        return [{"error": f"the evaluation rounds could not be read: {ledger.error}"}]
    return [json.loads(ledger.eval_rounds[v]) for v in sorted(ledger.eval_rounds)]


def accounting_report(ledger: ev.SchedulerFacts) -> dict[str, Any]:
    """The report's `trajectories_accounting` from the scheduler's ledger."""
    if ledger.error:
        return {"error": f"the ledger could not be read: {ledger.error}"}
    return {
        "handed_to_trainer": ledger.published,
        "trained": ledger.trained,
        "dropped": ledger.dropped,
        "open_at_end": ledger.open_at_end,
        "lost_ids": list(ledger.lost_ids),
    }


def serving_engines(plan: ev.Plan | None) -> set[str] | None:
    """Engines in a serving role in `plan`; None when no plan could be read."""
    if plan is None:
        return None
    return {a.worker_id for a in plan.assignments if a.role in SERVING_ROLES}


async def engine_versions(
    engines: list[ev.WorkerStatus],
    plan: ev.Plan | None,
    token: str | None = None,
    tls: TlsFiles | None = None,
) -> list[dict[str, Any]]:
    """Asks every engine of the job, over gRPC (TLS when the stack has a CA), which weight version
    it serves, at the address the planner's plan has for it (never one from a heartbeat: the bearer
    token goes only where the planner registered that engine)."""
    import grpc

    from services.common.tls import grpc_channel

    registered = {a.worker_id: a for a in plan.assignments} if plan is not None else {}
    out = []
    for st in engines:
        a = registered.get(st.worker_id)
        addr = a.weight_sync_addr if a is not None else ""
        entry: dict[str, Any] = {
            "id": st.worker_id,
            "weight_sync_addr": addr,
            "bucket": a.bucket if a is not None else None,
        }
        if not addr:
            entry.update(weight_version=None, error="no weight-sync address in the planner's plan")
        else:
            try:
                async with grpc_channel(addr, tls) as ch:
                    info = await ws_grpc.WeightSyncStub(ch).GetVersion(
                        ws.VersionRequest(), timeout=10, metadata=bearer_metadata(token)
                    )
                entry.update(
                    weight_version=info.version,
                    checksum=info.checksum,
                    pushes_refused=dict(info.pushes_refused),
                )
            except grpc.RpcError as err:
                entry.update(weight_version=None, error=str(err.code()))
        out.append(entry)
    return out


def per_step(metrics: list[ev.TrainMetrics], committed_step: int | None = None) -> list[ev.TrainMetrics]:
    """One metrics message per train step, in step order, up to the committed step when given.

    The last step's metrics may carry ``done`` themselves or be repeated in a separate ``done`` message
    once every engine has the final weights; both count as that one step.
    """
    first: dict[int, ev.TrainMetrics] = {}
    for m in metrics:
        if m.step > 0 and (committed_step is None or m.step <= committed_step):
            first.setdefault(m.step, m)
    return [first[s] for s in sorted(first)]


def _sampled(m: ev.TrainMetrics) -> tuple[float, float, int]:
    """(mean, population std, count) of the rewards of every trajectory step `m` consumed."""
    if m.sampled_trajectories:
        return m.sampled_reward_mean, m.sampled_reward_std, m.sampled_trajectories
    return m.reward_mean, m.reward_std, m.trajectories


def reward_window(steps: list[ev.TrainMetrics]) -> dict[str, Any] | None:
    """Mean reward over the trajectories of `steps` with its 95 % t-interval, pooled from each
    step's mean, std and count (the per-trajectory rewards are not kept)."""
    parts = [_sampled(m) for m in steps]
    n = sum(c for _, _, c in parts)
    if n == 0:
        return None
    mean = sum(mu * c for mu, _, c in parts) / n
    if n == 1:
        return {"mean": round(mean, 4), "ci95": [round(mean, 4)] * 2, "trajectories": n}
    second = sum(c * (sd * sd + mu * mu) for mu, sd, c in parts) / n
    sd = math.sqrt(max(0.0, second - mean * mean) * n / (n - 1))
    h = t95(n - 1) * sd / math.sqrt(n)
    return {"mean": round(mean, 4), "ci95": [round(mean - h, 4), round(mean + h, 4)], "trajectories": n}


def learning_report(trained: list[ev.TrainMetrics], filtered: bool = True) -> dict[str, Any]:
    """What a step learned, per step: rewards (all sampled trajectories, and those trained on),
    the policy versions that sampled them, the off-policy corrections and the optimizer's state.
    `filtered`: zero-advantage groups were left out (`training.filter_zero_advantage`), so a step
    without an informative group made no optimizer update at all."""

    def col(name: str, digits: int = 5) -> list[float | None]:
        return [None if math.isnan(v := getattr(m, name)) else round(v, digits) for m in trained]

    idle = sum(m.groups_informative == 0 for m in trained)
    return {
        "reward_mean_per_step": [round(_sampled(m)[0], 4) for m in trained],
        "reward_ci95_per_step": [(reward_window([m]) or {"ci95": [0.0, 0.0]})["ci95"] for m in trained],
        "reward_first3": reward_window(trained[:3]),
        "reward_last3": reward_window(trained[-3:]),
        "policy_versions_per_step": [list(m.policy_versions) for m in trained],
        "logprob_mismatch_per_step": col("logprob_mismatch", 7),
        "groups_filtered_per_step": [m.groups_filtered for m in trained],
        "groups_informative_per_step": [m.groups_informative for m in trained],
        "overlong_filtered_per_step": [m.overlong_filtered for m in trained],
        "steps_without_update": idle,
        "warnings": [
            f"{idle} of {len(trained)} train steps had no group with a non-zero advantage (every "
            "sample of each group got the same reward): "
            + (
                "they changed no weight, only the version"
                if filtered
                else "no policy gradient (only weight decay and the optimizer's momentum moved the weights)"
            )
        ]
        if idle
        else [],
        "training_stats": {
            "trained_reward_mean": col("reward_mean", 4),
            "tokens": [m.tokens for m in trained],
            "entropy": col("entropy", 4),
            "kl_behaviour": col("kl", 6),
            "ref_kl": col("ref_kl", 6),
            "clip_fraction": col("clip_fraction", 4),
            "dual_clip_fraction": col("dual_clip_fraction", 4),
            "is_weight_mean": col("is_weight_mean", 4),
            "is_weight_max": col("is_weight_max", 4),
            "is_truncated_fraction": col("is_truncated_fraction", 4),
            "stale_token_fraction": col("stale_token_fraction", 4),
            "mismatch_tokens": [m.mismatch_tokens for m in trained],
            "grad_norm": col("grad_norm", 4),
            "lr": [m.lr for m in trained],
        },
    }


def reward_definition(task: TaskConfig) -> str:
    """What `reward_*` measures in this run, for the report."""
    if task.dataset == "synthetic":
        return "synthetic: 1 when the trajectory's last tool call worked (or it needed none)"
    if isinstance(task.dataset, ReasoningGymDataset):
        name = f"reasoning-gym {task.dataset.reasoning_gym}"
    elif isinstance(task.dataset, HubDataset):
        name = f"hf:{task.dataset.hf} ({task.dataset.split})"
    elif isinstance(task.dataset, VerifiersDataset):
        name = f"verifiers {task.dataset.verifiers} (harness {task.dataset.harness})"
    else:
        name = task.dataset.path if isinstance(task.dataset, DatasetFile) else task.dataset
    rest = f"task.reward {task.reward}" if task.reward else "0"
    if task.environment:
        return f"{name}: environment {task.environment}'s reward (episodes it does not score: {rest})"
    if isinstance(task.dataset, VerifiersDataset):
        return f"{name}: the task's own reward functions (verifiers' Task.score)"
    if task.runs_agent:
        agent = task.agent or " ".join(task.agent_command or [])
        return f"{name}: agent {agent}'s reward (runs that return None: {rest})"
    if isinstance(task.dataset, ReasoningGymDataset) and task.reward in (None, "reasoning_gym"):
        return f"{name}: the task's own scorer on the <answer> tag"
    if isinstance(task.dataset, OWN_DATASETS) or task.reward:
        return f"{name}: task.reward {task.reward or 'numeric'}"
    shaping = f" + {task.tool_bonus:g} when a tool call succeeded" if task.tool_bonus else " (task success)"
    return f"{task.dataset}: 1 for the right number, 0 otherwise{shaping}"


async def build_report(
    status: str,
    reason: str,
    stuck: dict[str, Any] | None,
    wall: float,
    *,
    config_path: Path,
    stack: Stack,
    watch: JobObserver,
    facts: JobFacts,
    targets: Mapping[str, ev.WorkerStatus],
    engine_statuses: list[ev.WorkerStatus],
    rejoined: Mapping[str, int],
    silences: Mapping[str, float],
) -> dict[str, Any]:
    """The report of a job that ended with `status` after `wall` seconds."""
    with contextlib.suppress(Exception):
        await watch.poll(facts.bus, facts.committed)
    cfg, p, run_id = facts.cfg, watch.progress, facts.run_id
    commit = await facts.committed()
    ledger = await facts.settled_ledger(
        commit.trained if commit else 0, 5.0 if status == "completed" else 0.0
    )
    with contextlib.suppress(Exception):
        await watch.poll(facts.bus, facts.committed)
    trained = per_step(watch.metrics, p.committed_step)
    plan = await facts.last_plan()
    engines = await engine_versions(engine_statuses, plan, stack.grpc_token(), stack.tls) if targets else []
    buckets = await facts.buckets()
    plans, changes = await facts.history()
    serving = serving_engines(plan)
    for e in engines:
        e["serving"] = serving is None or e["id"] in serving
        values = watch.worker_values.get(e["id"], {})
        if "tokens_total" in values:
            e["tokens_generated"] = int(values["tokens_total"])
        if "load_reports" in values:  # EngineLoad reports it published (on change, or a heartbeat)
            e["load_reports"] = int(values["load_reports"])
        if "prefix_cache_hit_rate" in values:  # vllm: prompt tokens found in its prefix cache
            e["prefix_cache_hit_rate"] = round(values["prefix_cache_hit_rate"], 4)
    stats = watch.stats or ev.SchedulerStats()
    report: dict[str, Any] = {
        "run_id": run_id,
        "status": status,
        "reason": reason,
        "config": str(config_path),
        "model": cfg.model.source,
        "rollout_backend": cfg.rollout.backend
        + (
            " (emulated: timings from the cost model, no real generation)"
            if cfg.rollout.backend == "emulated"
            else ""
        ),
        "training_backend": cfg.training.backend
        + (
            " (emulated: step times from the cost model, no weight changes)"
            if cfg.training.backend == "emulated"
            else ""
        ),
        "wall_s": round(wall, 2),
        "trajectories_completed": stats.trajectories_completed,
        "trajectories_per_s": round(stats.trajectories_completed / wall, 4) if wall > 0 else 0.0,
        "turns": stats.turns,
        "train_steps": p.committed_step,
        "final_weight_version": p.committed_version,
        "checkpoint": p.checkpoint,
        "trajectories_trained_twice": p.trained_twice,
        "trajectories_lost": None if ledger.error else ledger.lost,
        "trajectories_accounting": accounting_report(ledger),
        "eval": eval_report(cfg, ledger),
        "engines": engines,
        "all_engines_on_final_version": bool(engines)
        and all(  # drained engines get no more weights
            e.get("weight_version") == p.committed_version for e in engines if e["serving"]
        ),
        "reward": reward_definition(cfg.task),
        **learning_report(trained, cfg.filters_zero_advantage),
        "loss_per_step": [round(m.loss, 5) for m in trained],
        "step_s": [round(m.step_s, 2) for m in trained],
        "trajectories_per_step": [m.trajectories for m in trained],
        "weight_push": [
            {
                "version": w.version,
                "seconds": round(w.push_s, 3),
                "bytes": w.size_bytes,
                "dtype": w.dtype,
                "uploaded_bytes": w.uploaded_bytes,
                "delta_bytes": w.delta_bytes,
                "delta_engines": w.delta_engines,
                "relayed_engines": w.relayed_engines,
                "engines": list(w.engines),
            }
            for w in watch.pushes
            if w.version <= p.committed_version
        ],
        "tool_calls": dict(stats.tool_calls_by_status),
        **(
            {
                "agent_calls_refused": dict(stats.agent_calls_refused),
                "agent_history_rewrites": stats.agent_history_rewrites,
                "agent_alternatives_kept": stats.agent_alternatives_kept,
            }
            if cfg.task.runs_agent
            else {}
        ),
        "trajectories_failed": stats.trajectories_failed,
        "trajectories_failed_by_code": dict(stats.failures_by_code),
        "groups_replaced": stats.groups_replaced,
        "group_outcomes": dict(stats.group_outcomes),
        "buckets": buckets,
        "plans": plans,
        "role_changes": changes,
        "migrations": stats.migrations,
        "handed_back": {"turns": stats.turns_handed_back, "tokens_kept": stats.tokens_kept_on_hand_back},
        "turn_context_tokens": {
            "sent": stats.context_tokens_sent,
            "held_by_engines": stats.context_tokens_held,
        },
        "turn_bus_bytes": {
            "requests": stats.turn_request_bytes,
            "results": stats.turn_result_bytes,
            "per_turn": round((stats.turn_request_bytes + stats.turn_result_bytes) / stats.turns)
            if stats.turns
            else None,
        },
        "invalid_turn_results": {
            "by_engine": dict(stats.invalid_results_by_engine),
            "quarantined": list(stats.engines_quarantined),
        },
        "lending": lending_report(cfg, trained, changes),
        "routing_policy": cfg.rollout.policy,
        "speculation": None
        if cfg.rollout.speculative.method == "off"
        else {
            "method": cfg.rollout.speculative.method,
            **speculation_report(
                watch.spec.totals(),
                [watch.step_marks[s]["spec"] for s in sorted(watch.step_marks) if s <= p.committed_step],
            ),
        },
        "scheduler": {
            "decisions": stats.decisions,
            "decision_p50_us": round(stats.decision_p50_us, 1),
            "decision_p99_us": round(stats.decision_p99_us, 1),
            "decision_cpu_p50_us": round(stats.decision_cpu_p50_us, 1),
            "decision_cpu_p99_us": round(stats.decision_cpu_p99_us, 1),
            "dispatch_p50_us": round(stats.dispatch_p50_us, 1),
            "dispatch_p99_us": round(stats.dispatch_p99_us, 1),
            "cpu_utilisation": round(stats.cpu_utilisation, 3),
            "messages_received": stats.messages_received,
            "messages_published": stats.messages_published,
        },
        "services": {wid: st.pid for wid, st in sorted(targets.items())},
        "restarts": {
            n: c
            for n, c in sorted(stack.worker_restarts().items())
            if n in targets or n in ("nats-server", "redis-server")
        },
        "rejoined": dict(sorted(rejoined.items())),
        "longest_silence_s": {w: round(q, 1) for w, q in sorted(silences.items())},
        "stack": stack.name,
        "logs": None if stack.remote else str(stack.log_dir),
        "nats_url": stack.nats_url,
        "redis_url": stack.redis_url,
    }
    if stuck is not None:
        report["stuck"] = stuck

    report["timeline"] = watch.timeline()  # written beside the report, not in it
    return report


def write_report(report: dict[str, Any], runs_dir: Path) -> Path:
    out = runs_dir / report["run_id"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    timeline = report.pop("timeline", None)
    plots: list[Path] = []
    try:
        if (plot := write_reward_plot(report, out)) is not None:
            plots.append(plot)
        if timeline is not None:
            (out / "timeline.json").write_text(json.dumps(timeline) + "\n")
            plots += write_run_plots(timeline, report["run_id"], out)
    except Exception as err:  # a plot must never cost the report
        report["plot_error"] = f"{type(err).__name__}: {err}"
    if plots:
        report["plots"] = [str(p) for p in plots]
    path.write_text(json.dumps(report, indent=2) + "\n")
    latest = runs_dir / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(out.name)
    remember_runs_dir(runs_dir)
    return path


def export_final(cfg: RunConfig, report: dict[str, Any], out_dir: Path) -> str:
    """The trained policy in Hugging Face format in runs/<id>/final (or why it is not there)."""
    from tools.export import ExportError, export_policy

    ckpt = report.get("checkpoint") or ""
    try:
        out = export_policy(cfg, Path(ckpt), out_dir / "final", run_id=report["run_id"])
    except ExportError as e:
        print(f"policy not exported: {e}", file=sys.stderr)
        return f"not exported: {e}"
    print(f"policy: {out} (Hugging Face format)", file=sys.stderr)
    return str(out)


def lending_report(
    cfg: RunConfig, trained: list[ev.TrainMetrics], changes: list[dict[str, Any]] | dict[str, str]
) -> dict[str, Any] | None:
    """The trainer's GPUs lent to rollout (planner.lending): times lent and taken back and wall
    seconds lent (the trainer's count, since it last started), and the turns the reclaimed
    engines handed back to go on elsewhere (the planner's role history)."""
    if cfg.planner.lending.engines == 0:
        return None
    last = trained[-1] if trained else ev.TrainMetrics()
    moved = None
    if isinstance(changes, list):
        moved = sum(c.get("turns_handed_back", 0) for c in changes if c["from"] == LENT_ROLE)
    return {
        "engines": cfg.planner.lending.engines,
        "lends": last.lends,
        "reclaims": last.reclaims,
        "early_reclaims": last.early_reclaims,
        "policy": cfg.planner.lending.policy,
        "seconds_lent": round(last.seconds_lent, 3),
        "turns_moved": moved,
        # the trainer's own engine (planner.lending.trainer_serves): turns it answered while lent
        "turns_served_by_trainer": last.lent_turns_answered if cfg.planner.lending.trainer_serves else None,
    }


def completing_step(source: str, target: str) -> str | None:
    """The worker's step that completes a move (None: the plan itself completes it, as for a
    move between buckets or back from `draining`)."""
    if source == "hybrid":
        return "released"  # the trainer let it go
    if target == "hybrid":
        return "joined"  # in the trainer's data-parallel group
    if target in ("draining", SPARE_ROLE) and source not in ("draining", SPARE_ROLE):
        return "drained"
    if target == PARKED_ROLE and source != PARKED_ROLE:
        return PARKED_ROLE  # lent GPUs back with the trainer: the engine handed its turns back
    return None


def role_changes(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The planner's role history (changes, and the workers' steps through them, in order) as one
    entry per change: worker, from, to, when, why, bucket and TP (as the planner recorded them),
    `seconds` until the worker completed it (None while it has not), and the seconds of each step (drain, fetch, join; time in training on release)."""
    out: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}
    for h in history:
        worker = h.get("worker", "")
        if "to" in h:
            entry = {
                "worker": worker,
                "from": h.get("from", ""),
                "to": h["to"],
                "at": h.get("at", 0.0),
                "seconds": None,
                "steps": {},
                "failures": 0,
                "turns_handed_back": 0,
            }
            entry.update({k: h[k] for k in ("why", "bucket", "tp") if k in h})
            done_by = completing_step(entry["from"], entry["to"])
            entry["seconds"] = None if done_by else 0.0
            out.append(entry)
            current[worker] = entry
            continue
        change = current.get(worker)
        state = h.get("state", "")
        if change is None or not state:
            continue
        if state == "failed":
            change["failures"] += 1
            continue
        change["steps"][state] = h.get("seconds", 0.0)
        change["turns_handed_back"] += int(h.get("turns_handed_back", 0))
        if state == completing_step(change["from"], change["to"]) and change["seconds"] is None:
            change["seconds"] = round(max(0.0, h.get("at", 0.0) - change["at"]), 3)
    return out
