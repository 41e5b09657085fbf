"""`libra run`: submits one job to a Libra stack, watches it, and always writes runs/<run-id>/report.json.

The stack is the one `libra up` started (found through .libra/stack.json), or, when none is up, an
embedded one started for this job and stopped after it; either way the services are the same idle
processes and the job reaches them over the control plane (services/common/control.py).

The report comes from authoritative state, not from whichever message arrived on the bus: the step
count and final version from the trainer's fenced commit record in Redis, each engine's version from
the engine itself over gRPC. The job ends as `completed`, `failed` (a service died, stopped answering,
or reported the job failed) or `timed_out` (no trajectory completed and no step was trained for the
config's `job.stall_timeout_s`, or the overall `--timeout` passed), with what was stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import control, subjects
from services.common.bus import Bus, Envelope, close_nats
from services.common.contracts import ev, ws, ws_grpc
from services.common.grpc_auth import bearer_metadata
from services.common.membership import SERVING_ROLES
from services.common.ownership import committed_key, plans_key, role_changes_key, trained_key
from services.common.runconfig import DatasetFile, ModelConfig, RunConfig, TaskConfig
from services.scheduler.ledger import Accounting, read_accounting
from tools.learning_plot import write_reward_plot
from tools.loggers import LoggerUnavailable, StepLoggers, check_loggers
from tools.run_plots import write_run_plots
from tools.sim.stats import t95
from tools.stack import Stack, read_stack_file

SERVICES_NEEDED = ("planner", "scheduler", "trainer", "tool-sandbox")
LIVENESS_S = 30.0  # a planner, scheduler or trainer without a heartbeat for this long has stopped
SINGLETONS = ("planner", "scheduler", "trainer")  # engines and sandboxes are many: the job goes on
READY_S = 120.0  # how long to wait for the stack's services to be idle and reachable
PLOT_REFRESH_S = 60.0  # plots of a running job are redrawn this often
MAX_TIMELINE = 200_000  # samples kept per series (about two days at one a second)


class JobEnded(Exception):
    """Ends the watch with a final status other than completed."""

    def __init__(self, status: str, reason: str, stuck: dict[str, Any] | None = None):
        super().__init__(reason)
        self.status, self.reason, self.stuck = status, reason, stuck


@dataclass
class Progress:
    committed_step: int = 0
    committed_version: int = 0
    checkpoint: str = ""
    trained_twice: int = 0
    completed: int = 0
    in_flight: int = 0
    last_change: float = field(default_factory=time.monotonic)

    def update(self, committed: dict[str, str], stats: ev.SchedulerStats | None) -> None:
        step = int(committed.get("step", 0))
        done = stats.trajectories_completed if stats is not None else self.completed
        if (step, done) != (self.committed_step, self.completed):
            self.last_change = time.monotonic()
        self.committed_step, self.completed = step, done
        self.committed_version = int(committed.get("version", 0))
        self.checkpoint = committed.get("checkpoint", "")
        self.trained_twice = int(committed.get("trained_twice", 0))
        if stats is not None:
            self.in_flight = stats.trajectories_in_flight


async def engine_versions(engines: list[ev.WorkerStatus], token: str | None = None) -> list[dict[str, Any]]:
    """Asks every engine of the job, over gRPC, which weight version it serves."""
    import grpc

    out = []
    for st in engines:
        addr = st.detail.get("weight_sync_addr", "")
        entry: dict[str, Any] = {
            "id": st.worker_id,
            "weight_sync_addr": addr,
            "bucket": st.detail.get("bucket"),
        }
        if not addr:
            entry.update(weight_version=None, error="no weight-sync address reported")
        else:
            try:
                async with grpc.aio.insecure_channel(addr) as ch:
                    info = await ws_grpc.WeightSyncStub(ch).GetVersion(
                        ws.VersionRequest(), timeout=10, metadata=bearer_metadata(token)
                    )
                entry.update(weight_version=info.version, checksum=info.checksum)
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


def learning_report(trained: list[ev.TrainMetrics]) -> dict[str, Any]:
    """What a step learned, per step: rewards (all sampled trajectories, and those trained on),
    the policy versions that sampled them, the off-policy corrections and the optimizer's state."""

    def col(name: str, digits: int = 5) -> list[float | None]:
        return [None if math.isnan(v := getattr(m, name)) else round(v, digits) for m in trained]

    return {
        "reward_mean_per_step": [round(_sampled(m)[0], 4) for m in trained],
        "reward_ci95_per_step": [(reward_window([m]) or {"ci95": [0.0, 0.0]})["ci95"] for m in trained],
        "reward_first3": reward_window(trained[:3]),
        "reward_last3": reward_window(trained[-3:]),
        "policy_versions_per_step": [list(m.policy_versions) for m in trained],
        "logprob_mismatch_per_step": col("logprob_mismatch", 7),
        "groups_filtered_per_step": [m.groups_filtered for m in trained],
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


def job_config_yaml(cfg: RunConfig) -> str:
    """The config a job is submitted with: what the file and the command-line overrides set."""
    import yaml

    return str(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False))


def _model_paths(model: ModelConfig) -> dict[str, str]:
    paths = {"cache_dir": str(Path(model.cache_dir).resolve())}
    if model.path is not None:
        paths["path"] = str(Path(model.path).resolve())
    return paths


def with_local_paths(cfg: RunConfig, runs_dir: Path) -> RunConfig:
    """The config with its relative paths (model, dataset, plugins, checkpoints) made absolute from
    where `libra run` started, since the services may have started elsewhere; checkpoints default
    to <runs_dir>/<run-id>/checkpoints."""
    task: dict[str, Any] = {}
    if isinstance(cfg.task.dataset, DatasetFile):
        path = str(Path(cfg.task.dataset.path).resolve())
        task["dataset"] = cfg.task.dataset.model_copy(update={"path": path})
    for key in ("plugin_paths", "tool_plugins"):
        if key in cfg.task.model_fields_set:
            task[key] = [str(Path(p).resolve()) for p in getattr(cfg.task, key)]
    ckpt = cfg.training.checkpoint_dir
    if "checkpoint_dir" not in cfg.training.model_fields_set:
        ckpt = str(runs_dir / "{run_id}" / "checkpoints")
    training: dict[str, Any] = {"checkpoint_dir": str(Path(ckpt).resolve())}
    if (ref := cfg.training.reference_model) is not None:
        training["reference_model"] = ref.model_copy(update=_model_paths(ref))
    return cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update=_model_paths(cfg.model)),
            "task": cfg.task.model_copy(update=task),
            "training": cfg.training.model_copy(update=training),
        }
    )


def check_task(cfg: RunConfig) -> None:
    """Reads the dataset and loads the reward and the environment as the scheduler will, so that a
    bad file, a missing key or a reward that cannot be imported stops the run before anything
    starts."""
    from services.scheduler.datasets import DatasetError
    from services.scheduler.environment import check_environment
    from services.scheduler.feed import task_list
    from services.scheduler.plugins import PluginLoadError
    from services.scheduler.rewards import check_reward
    from services.tool_sandbox.tools import TOOLS
    from services.tool_sandbox.tools.script import ToolPluginError, read_plugin, tool_plugin_files

    try:
        task_list(cfg.task)
        asyncio.run(check_reward(cfg.task))
        if cfg.task.environment:
            asyncio.run(check_environment(cfg.task.environment, cfg.task.plugin_paths))
        names = set(TOOLS)
        for path in tool_plugin_files(cfg.task.tool_plugins):
            name = read_plugin(path)[0]
            if name in names:
                raise ToolPluginError(f"{path}: tool {name!r} is already a built-in or another plugin's")
            names.add(name)
        unknown = sorted(set(cfg.task.tools or []) - names)
        if unknown:
            raise ToolPluginError(f"task.tools: unknown {unknown}; known: {sorted(names)}")
        check_loggers(cfg)
    except (DatasetError, PluginLoadError, ToolPluginError, LoggerUnavailable) as e:
        print(f"invalid configuration: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def reward_definition(task: TaskConfig) -> str:
    """What `reward_*` measures in this run, for the report."""
    if task.dataset == "synthetic":
        return "synthetic: 1 when the trajectory's last tool call worked (or it needed none)"
    name = task.dataset.path if isinstance(task.dataset, DatasetFile) else task.dataset
    if task.environment:
        rest = f"task.reward {task.reward}" if task.reward else "0"
        return f"{name}: environment {task.environment}'s reward (episodes it does not score: {rest})"
    if isinstance(task.dataset, DatasetFile) or task.reward:
        return f"{name}: task.reward {task.reward or 'numeric'}"
    shaping = f" + {task.tool_bonus:g} when a tool call succeeded" if task.tool_bonus else " (task success)"
    return f"{task.dataset}: 1 for the right number, 0 otherwise{shaping}"


class JobDriver:
    def __init__(
        self,
        stack: Stack,
        cfg: RunConfig,
        config_path: Path,
        run_id: str,
        *,
        timeout_s: float | None,
        progress: bool,
        out_dir: Path | None = None,
    ):
        self.stack, self.cfg, self.config_path, self.run_id = stack, cfg, config_path, run_id
        self.out_dir = out_dir
        """runs/<id>: the services write the job's spans to its traces/ (`libra trace` reads them);
        the timeline's plots are refreshed there while the job runs."""
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.engine_loads: list[dict[str, Any]] = []
        self.step_marks: dict[int, dict[str, Any]] = {}
        self._plotted = time.monotonic()
        self.timeout_s, self.show_progress = timeout_s, progress
        self.metrics: list[ev.TrainMetrics] = []
        self.pushes: list[ev.WeightsUpdated] = []
        self.statuses: dict[str, ev.WorkerStatus] = {}
        self.seen: dict[str, float] = {}
        self.elsewhere: dict[str, float] = {}
        self.rejoined: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.silences: dict[str, float] = {}
        self.targets: dict[str, ev.WorkerStatus] = {}
        self.progress = Progress()
        self.stats: ev.SchedulerStats | None = None
        self.loggers = StepLoggers(cfg, run_id, out_dir)

    async def run(self) -> dict[str, Any]:
        import redis.asyncio as aioredis

        auth = self.stack.nats_auth("cli")
        self.nc = await control.connect(self.stack.nats_url, f"cli:{os.getpid()}:control", auth)
        self.bus = await Bus.connect(self.stack.nats_url, self.run_id, "cli", f"cli-{os.getpid()}", auth)
        self.redis = aioredis.from_url(
            self.stack.redis_url, decode_responses=True, password=self.stack.redis_password()
        )
        start = time.monotonic()
        status, reason, stuck = "failed", "", None
        submitted = False
        stopped: dict[str, ev.JobAck] = {}
        try:
            await self.nc.subscribe(control.HEARTBEAT, cb=self._on_heartbeat)
            await self.bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, self._on_metrics)
            await self.bus.subscribe(subjects.WEIGHTS_UPDATED, ev.WeightsUpdated, self._on_weights)
            await self.bus.subscribe(subjects.ENGINE_LOAD, ev.EngineLoad, self._on_load)
            await self._choose_workers()
            submitted = True
            await self._submit()
            start = self.t0 = time.monotonic()
            await self._watch(start)
            status, reason = "completed", f"trained {self.cfg.training.steps} steps"
        except JobEnded as end:
            status, reason, stuck = end.status, end.reason, end.stuck
        finally:
            wall = time.monotonic() - start
            report = await self._report(status, reason, stuck, wall)  # engines asked before they stop
            dead = sorted(set(self.stack.dead()) & set(self.targets))  # a trainer a standby replaced
            alive = [t for t in self.targets if t not in dead]
            if submitted:
                stopped = await control.command(
                    self.nc, control.JOB_STOP, ev.JobStop(run_id=self.run_id, reason=status), alive, 30
                )
            report["services_not_stopped"] = sorted(set(alive) - set(stopped))
            report["services_dead"] = dead
            await asyncio.to_thread(self.loggers.close, status)
            await self.bus.close()
            await close_nats(self.nc)
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        return report

    # --- bus callbacks -------------------------------------------------------------------------

    async def _on_heartbeat(self, raw: Any) -> None:
        with contextlib.suppress(Exception):
            st = ev.WorkerStatus.FromString(raw.data)
            if st.worker_id in self.targets:
                self.statuses[st.worker_id] = st
                self.seen[st.worker_id] = time.monotonic()

    async def _on_metrics(self, m: ev.TrainMetrics, _: Envelope) -> None:
        self.metrics.append(m)
        if self.loggers.active:
            await asyncio.to_thread(self.loggers.step, m)  # a remote MLflow must not stall the loop
        if m.step > 0:
            self.step_marks[m.step] = {
                "t": round(time.monotonic() - self.t0, 2),
                "step": m.step,
                "step_s": round(m.step_s, 3),
                "push_s": round(m.push_s, 3),
            }

    async def _on_load(self, load: ev.EngineLoad, _: Envelope) -> None:
        if load.engine_id in self.targets and len(self.engine_loads) < MAX_TIMELINE:
            self.engine_loads.append(
                {
                    "t": round(time.monotonic() - self.t0, 2),
                    "engine": load.engine_id,
                    "running": load.running,
                    "waiting": load.waiting,
                    "capacity": load.capacity_seqs,
                    "tokens_per_s": round(load.tokens_per_s, 2),
                }
            )

    def timeline(self) -> dict[str, Any]:
        """What the run did over time (runs/<id>/timeline.json, drawn by tools/run_plots.py)."""
        steps = [self.step_marks[k] for k in sorted(self.step_marks)]
        return {"samples": self.samples, "engines": self.engine_loads, "steps": steps}

    async def _refresh_plots(self) -> None:
        if self.out_dir is None or time.monotonic() - self._plotted < PLOT_REFRESH_S:
            return
        self._plotted = time.monotonic()
        with contextlib.suppress(Exception):  # a plot never costs the job
            await asyncio.to_thread(write_run_plots, self.timeline(), self.run_id, self.out_dir)

    async def _on_weights(self, w: ev.WeightsUpdated, _: Envelope) -> None:
        self.pushes.append(w)

    # --- phases --------------------------------------------------------------------------------

    def _fail_if_dead(self) -> None:
        dead = self.stack.dead()
        for name, code in dead.items():
            if self._has_standby(name, dead):
                continue
            tail = self.stack.log_tail(name)
            how = f"exited with code {code}" if code is not None else "exited"
            n = self.stack.restarts.get(name, 0)
            after = (
                f" (after {n} restart(s); no more)"
                if n
                else " (restarts are off)"
                if not self.stack.max_restarts
                else ""
            )
            raise JobEnded("failed", f"service {name} {how}{after}; last log lines:\n{tail}")

    def _has_standby(self, name: str, dead: dict[str, int | None]) -> bool:
        """A dead trainer is not the end of the job while another trainer of it lives (a standby
        takes the role when the dead one's lease runs out)."""
        st = self.targets.get(name)
        if st is None or st.service != "trainer":
            return False
        return any(w not in dead for w, o in self.targets.items() if o.service == "trainer" and w != name)

    async def _choose_workers(self) -> None:
        """Picks idle services for the job: one planner and scheduler, every trainer (the planner
        gives one the role, the others stand by), every tool sandbox and exactly `rollout.engines`
        engines; waits for them while the stack is starting."""
        need_engines = self.cfg.rollout.engines
        deadline = time.monotonic() + READY_S
        problem = "no service answered on the control plane"
        while time.monotonic() < deadline:
            self._fail_if_dead()
            found = await control.discover(self.nc, wait_s=1.0)
            busy = sorted({st.run_id for st in found if st.state != "idle"})
            if busy:
                problem = f"the stack is busy with job(s) {', '.join(busy)}"
                continue
            by_kind: dict[str, list[ev.WorkerStatus]] = {}
            for st in sorted(found, key=lambda s: s.worker_id):
                by_kind.setdefault(st.service, []).append(st)
            missing = [k for k in SERVICES_NEEDED if not by_kind.get(k)]
            # every live trainer of the stack takes part (standbys too: a dead trainer is then not
            # the end of the job), so wait for those still starting
            trainers = {st.worker_id for st in by_kind.get("trainer", [])}
            starting = self.stack.trainers() - trainers - set(self.stack.dead())
            missing += sorted(starting)
            engines = by_kind.get("rollout-engine", [])
            if not missing and len(engines) >= need_engines:
                chosen = [by_kind[k][0] for k in ("planner", "scheduler")]
                chosen += by_kind["trainer"] + by_kind["tool-sandbox"] + engines[:need_engines]
                self.targets = {st.worker_id: st for st in chosen}
                self.pids = {st.worker_id: st.pid for st in chosen}
                now = time.monotonic()
                self.seen = dict.fromkeys(self.targets, now)
                return
            problem = (
                f"the job needs {need_engines} rollout engine(s) and one each of {', '.join(SERVICES_NEEDED)}; "
                f"idle on the stack: {len(engines)} engine(s)"
                + (f", missing {', '.join(missing)}" if missing else "")
            )
        raise JobEnded("failed", f"could not start the job: {problem}")

    async def _submit(self) -> None:
        self.spec = spec = ev.JobSpec(
            run_id=self.run_id,
            config_yaml=job_config_yaml(self.cfg),
            config_name=str(self.config_path),
            targets=sorted(self.targets),
            trace_dir=str((self.out_dir / "traces").resolve()) if self.out_dir else "",
        )
        acks = await control.command(self.nc, control.JOB_START, spec, sorted(self.targets), timeout_s=30)
        refused = [a for a in acks.values() if not a.ok]
        if refused:
            a = refused[0]
            raise JobEnded("failed", f"{a.worker_id} refused the job ({a.error.code}): {a.error.message}")
        silent = sorted(set(self.targets) - set(acks))
        if silent:
            self._fail_if_dead()
            raise JobEnded("failed", f"no answer to the job start from {', '.join(silent)}")
        print(f"job {self.run_id} started on {len(self.targets)} services", file=sys.stderr)

    async def _watch(self, start: float) -> None:
        from tqdm import tqdm

        steps = self.cfg.training.steps
        stall_s = self.cfg.job.stall_timeout_s
        bar = tqdm(
            total=steps,
            desc="train steps",
            unit="step",
            disable=not self.show_progress,
            file=sys.stderr,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,  # a log file gets a line every 30 s
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}",
        )
        self.progress.last_change = time.monotonic()
        try:
            while True:
                await asyncio.sleep(1.0)
                if self.stack.procs:
                    for name in self.stack.supervise():
                        print(f"service {name} died and was restarted", file=sys.stderr)
                else:
                    self.stack.refresh()
                self._fail_if_dead()
                await self._check_participants()
                await self._poll()
                await self._refresh_plots()
                p = self.progress
                bar.n = p.committed_step
                reward = f"{self.metrics[-1].reward_mean:.3f}" if self.metrics else "-"
                bar.set_postfix_str(
                    f"trajectories={p.completed} in_flight={p.in_flight} reward={reward}", refresh=False
                )
                bar.update(0)
                if p.committed_step >= steps and await self._engines_final() and await self._evaluated():
                    return
                now = time.monotonic()
                if now - p.last_change > stall_s:
                    raise JobEnded(
                        "timed_out",
                        f"no trajectory completed and no step was trained for {now - p.last_change:.0f}s "
                        f"(job.stall_timeout_s={stall_s:g}) at step {p.committed_step}/{steps}",
                        await self._stuck(),
                    )
                if self.timeout_s is not None and now - start > self.timeout_s:
                    raise JobEnded(
                        "timed_out",
                        f"the job did not finish within {self.timeout_s:.0f}s (at step {p.committed_step}/{steps})",
                        await self._stuck(),
                    )
        finally:
            bar.close()

    async def _check_participants(self) -> None:
        now = time.monotonic()
        for wid in self.targets:
            st = self.statuses.get(wid)
            if st is not None and st.run_id == self.run_id and st.state == "failed":
                raise JobEnded("failed", f"{wid} failed the job ({st.error.code}): {st.error.message}")
            if st is None or st.run_id == self.run_id:
                self.elsewhere.pop(wid, None)
            elif (
                st.pid != self.pids.get(wid)
                or now - self.elsewhere.setdefault(wid, now) > 3 * control.HEARTBEAT_S
            ):
                # a new process (restarted) at once; otherwise only a lasting state counts, as a
                # heartbeat sent just before the start can arrive after it
                await self._rejoin(wid, st)
                self.pids[wid] = st.pid
            quiet = now - self.seen.get(wid, now)
            service = self.targets[wid].service
            if quiet > LIVENESS_S and service in SINGLETONS:
                peers = [w for w, st in self.targets.items() if st.service == service]
                if all(now - self.seen.get(w, now) > LIVENESS_S for w in peers):
                    raise JobEnded("failed", f"{wid} stopped answering (no heartbeat for {LIVENESS_S:.0f}s)")
            if quiet > 3 * control.HEARTBEAT_S:
                self.silences[wid] = max(self.silences.get(wid, 0.0), quiet)

    async def _rejoin(self, wid: str, st: ev.WorkerStatus) -> None:
        """A participant that came back idle (restarted by its supervisor) is given the job again;
        it resumes from the job's durable state (the trainer's checkpoint, the scheduler's ledger)."""
        if st.state != "idle":
            raise JobEnded("failed", f"{wid} is no longer running the job: it runs {st.run_id!r}")
        acks = await control.command(self.nc, control.JOB_START, self.spec, [wid], timeout_s=15)
        ack = acks.get(wid)
        if ack is None or not ack.ok:
            reason = f"{ack.error.code}: {ack.error.message}" if ack is not None else "no answer"
            raise JobEnded("failed", f"{wid} came back but did not rejoin the job ({reason})")
        self.rejoined[wid] = self.rejoined.get(wid, 0) + 1
        self.elsewhere.pop(wid, None)
        self.statuses.pop(wid, None)
        print(f"{wid} came back and rejoined the job", file=sys.stderr)

    async def _poll(self) -> None:
        stats = None
        with contextlib.suppress(Exception):
            stats = await self.bus.request(
                subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, timeout=2
            )
        if stats is not None:
            self.stats = stats
            if len(self.samples) < MAX_TIMELINE:
                self.samples.append(
                    {
                        "t": round(time.monotonic() - self.t0, 2),
                        "completed": stats.trajectories_completed,
                        "in_flight": stats.trajectories_in_flight,
                        "failed": stats.trajectories_failed,
                        "turns": stats.turns,
                        "tool_calls": dict(stats.tool_calls_by_status),
                    }
                )
        committed: dict[str, str] = {}
        with contextlib.suppress(Exception):
            raw = await self.redis.hgetall(committed_key(self.run_id))
            committed = {str(k): str(v) for k, v in raw.items()}
        self.progress.update(committed, stats)

    async def _eval_report(self) -> list[dict[str, Any]] | None:
        """Every evaluation round, by version (None when `eval` is off)."""
        if self.cfg.eval.every <= 0:
            return None
        try:
            return [r for _, r in sorted((await self._eval_rounds()).items())]
        except Exception as err:  # Redis away: the report still gets written, saying so
            return [{"error": f"the evaluation rounds could not be read: {type(err).__name__}: {err}"}]

    async def _eval_rounds(self) -> dict[int, dict[str, Any]]:
        """The finished evaluation rounds, as the scheduler recorded them in Redis."""
        from services.scheduler.ledger import Ledger

        return await Ledger(self.redis, self.run_id).load_eval()

    async def _evaluated(self) -> bool:
        """The final policy's evaluation is in (or none is configured)."""
        if self.cfg.eval.every <= 0:
            return True
        with contextlib.suppress(Exception):
            return self.cfg.training.steps in await self._eval_rounds()
        return False

    def _engines(self) -> list[ev.WorkerStatus]:
        return [self.statuses.get(w, st) for w, st in self.targets.items() if st.service == "rollout-engine"]

    async def _engines_final(self) -> bool:
        """Every engine the last plan has serving is on the committed version (an engine the
        planner took out of rollout gets no more weights and does not hold the job up)."""
        serving = await self._serving_engines()
        engines = [st for st in self._engines() if serving is None or st.worker_id in serving]
        versions = await engine_versions(engines, self.stack.grpc_token())
        return all(e.get("weight_version") == self.progress.committed_version for e in versions)

    async def _last_plan(self) -> ev.Plan | None:
        with contextlib.suppress(Exception):
            return await self.bus.last_message(
                subjects.PLAN, subjects.stream_name(self.run_id, "PLAN"), ev.Plan
            )
        return None

    async def _serving_engines(self) -> set[str] | None:
        """Engines in a serving role in the last plan; None when no plan can be read."""
        plan = await self._last_plan()
        if plan is None:
            return None
        return {a.worker_id for a in plan.assignments if a.role in SERVING_ROLES}

    async def _stuck(self) -> dict[str, Any]:
        """What a stalled job is waiting on: trajectories in flight, the trainer's groups, the engines."""
        s = self.stats
        out: dict[str, Any] = {}
        if s is not None:
            out["scheduler"] = {
                "trajectories_in_flight": s.trajectories_in_flight,
                "groups_launched": s.groups_launched,
                "groups_total": s.groups_total,
                "trained_version_heard": s.trained_version,
                "routable_engines": list(s.engines),
                "oldest_in_flight": [
                    {
                        "trajectory_id": f.trajectory_id,
                        "group_id": f.group_id,
                        "state": f.state,
                        "engine_id": f.engine_id,
                        "turns": f.turns,
                        "age_s": round(f.age_s, 1),
                        "idle_s": round(f.idle_s, 1),
                    }
                    for f in s.oldest_in_flight
                ],
            }
        else:
            out["scheduler"] = "no answer to a stats request"
        out["services"] = {
            wid: {"state": st.state, **dict(st.detail)} for wid, st in sorted(self.statuses.items())
        }
        out["engines"] = await engine_versions(self._engines(), self.stack.grpc_token())
        return out

    async def _buckets(self) -> list[dict[str, Any]]:
        """The rollout buckets of the job's last plan, with the engines assigned to each."""
        with contextlib.suppress(Exception):
            plan = await self._last_plan()
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

    async def _plans(self) -> list[dict[str, Any]] | dict[str, str]:
        """Every plan of the run, from the planner's fenced plan history in Redis."""
        try:
            return [json.loads(x) for x in await self.redis.lrange(plans_key(self.run_id), 0, -1)]
        except Exception as err:  # Redis away: the report says so
            return {"error": f"the plan history could not be read: {type(err).__name__}: {err}"}

    async def _role_changes(self) -> list[dict[str, Any]] | dict[str, str]:
        """Every role change of the run with what it cost, from the planner's history in Redis."""
        try:
            lines = await self.redis.lrange(role_changes_key(self.run_id), 0, -1)
        except Exception as err:
            return {"error": f"the role history could not be read: {type(err).__name__}: {err}"}
        return role_changes([json.loads(x) for x in lines])

    async def _report(
        self,
        status: str,
        reason: str,
        stuck: dict[str, Any] | None,
        wall: float,
    ) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            await self._poll()
        cfg, p = self.cfg, self.progress
        trained_groups = cfg.training.steps * cfg.training.groups_per_step
        for _ in range(20):  # the scheduler hears the last step's group outcomes a tick after the commit
            if status != "completed" or (
                self.stats and self.stats.group_outcomes["trained"] >= trained_groups
            ):
                break
            await asyncio.sleep(0.25)
            with contextlib.suppress(Exception):
                await self._poll()
        trained = per_step(self.metrics, p.committed_step)
        accounting_error = ""
        try:
            accounting: Accounting | None = await read_accounting(
                self.redis, self.run_id, trained_key(self.run_id)
            )
        except Exception as err:  # Redis away: the report still gets written, saying so
            accounting, accounting_error = None, f"{type(err).__name__}: {err}"
        engines = await engine_versions(self._engines(), self.stack.grpc_token()) if self.targets else []
        buckets = await self._buckets()
        plans = await self._plans()
        changes = await self._role_changes()
        serving = await self._serving_engines()
        for e in engines:
            e["serving"] = serving is None or e["id"] in serving
        stats = self.stats or ev.SchedulerStats()
        report: dict[str, Any] = {
            "run_id": self.run_id,
            "status": status,
            "reason": reason,
            "config": str(self.config_path),
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
            "trajectories_lost": len(accounting.lost) if accounting else None,
            "trajectories_accounting": {
                "handed_to_trainer": accounting.published,
                "trained": accounting.trained,
                "dropped": accounting.dropped,
                "open_at_end": accounting.open_at_end,
                "lost_ids": accounting.lost[:20],
            }
            if accounting
            else {"error": f"the ledger could not be read: {accounting_error}"},
            "eval": await self._eval_report(),
            "engines": engines,
            "all_engines_on_final_version": bool(engines)
            and all(  # drained engines get no more weights
                e.get("weight_version") == p.committed_version for e in engines if e["serving"]
            ),
            "reward": reward_definition(self.cfg.task),
            **learning_report(trained),
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
                for w in self.pushes
                if w.version <= p.committed_version
            ],
            "tool_calls": dict(stats.tool_calls_by_status),
            "trajectories_failed": stats.trajectories_failed,
            "trajectories_failed_by_code": dict(stats.failures_by_code),
            "groups_replaced": stats.groups_replaced,
            "group_outcomes": dict(stats.group_outcomes),
            "buckets": buckets,
            "plans": plans,
            "role_changes": changes,
            "migrations": stats.migrations,
            "routing_policy": cfg.rollout.policy,
            "scheduler": {
                "decisions": stats.decisions,
                "decision_p50_us": round(stats.decision_p50_us, 1),
                "decision_p99_us": round(stats.decision_p99_us, 1),
                "messages_received": stats.messages_received,
                "messages_published": stats.messages_published,
            },
            "services": {wid: st.pid for wid, st in sorted(self.targets.items())},
            "restarts": {
                n: c
                for n, c in sorted(self.stack.restarts.items())
                if n in self.targets or n in ("nats-server", "redis-server")
            },
            "rejoined": dict(sorted(self.rejoined.items())),
            "longest_silence_s": {w: round(q, 1) for w, q in sorted(self.silences.items())},
            "stack": self.stack.name,
            "logs": None if self.stack.remote else str(self.stack.log_dir),
            "nats_url": self.stack.nats_url,
            "redis_url": self.stack.redis_url,
        }
        if stuck is not None:
            report["stuck"] = stuck
        report["timeline"] = self.timeline()  # written beside the report, not in it
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
    return path


def run_job(
    config_path: Path,
    cfg: RunConfig,
    *,
    run_id: str | None = None,
    runs_dir: Path = Path("runs"),
    timeout_s: float | None = None,
    otlp_endpoint: str | None = None,
    progress: bool = True,
    extra_env: dict[str, str] | None = None,
    stack: Stack | None = None,
    max_restarts: int = 5,
) -> dict[str, Any]:
    """Runs one job on `stack`, on the stack `libra up` started, or on an embedded stack of its own,
    and writes its report whatever the outcome."""
    from services.common.models import check_reference, resolve_model_dir

    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs_dir = runs_dir.resolve()
    check_task(cfg)
    cfg = with_local_paths(cfg, runs_dir)
    print(f"preparing model '{cfg.model.source}' (converted once, then cached)…", file=sys.stderr)
    resolve_model_dir(cfg.model)
    if cfg.training.kl_coef > 0:
        check_reference(cfg.model, cfg.training.reference_model)  # builds it too, like the policy
    owned = False
    if stack is None:
        live = read_stack_file()
        if live is not None:
            stack = Stack.attach(live)
            print(f"run {run_id} on the stack {stack.name} (libra up)", file=sys.stderr)
        else:
            stack = Stack(
                f"embedded-{run_id}",
                runs_dir / run_id / "logs",
                otlp_endpoint,
                dict(extra_env or {}),
                max_restarts=max_restarts,
            )
            stack.start_infra()
            stack.start_services(cfg.rollout.engines)
            owned = True
            print(f"run {run_id} on an embedded stack", file=sys.stderr)
    logs = "on the services' hosts" if stack.remote else str(stack.log_dir)
    print(f"  nats {stack.nats_url}  redis {stack.redis_url}  logs {logs}", file=sys.stderr)
    out_dir = runs_dir / run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(job_config_yaml(cfg))  # as run, overrides included
    try:
        driver = JobDriver(
            stack,
            cfg,
            config_path,
            run_id,
            timeout_s=timeout_s,
            progress=progress,
            out_dir=out_dir,
        )
        report = asyncio.run(driver.run())
    finally:
        if owned:
            stack.stop()
    if report["status"] == "completed" and cfg.job.export_final and cfg.training.backend != "emulated":
        report["final_policy"] = export_final(cfg, report, out_dir)
    report["report_path"] = str(write_report(report, runs_dir))
    return report


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


def completing_step(source: str, target: str) -> str | None:
    """The worker's step that completes a move (None: the plan itself completes it, as for a
    move between buckets or back from `draining`)."""
    if source == "hybrid":
        return "released"  # the trainer let it go
    if target == "hybrid":
        return "joined"  # in the trainer's data-parallel group
    if target == "draining" and source != "draining":
        return "drained"
    return None


def role_changes(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The planner's role history (changes, and the workers' steps through them, in order) as one
    entry per change: worker, from, to, when, `seconds` until the worker completed it (None while
    it has not), and the seconds of each step (drain, fetch, join; time in training on release)."""
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
            }
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
        if state == completing_step(change["from"], change["to"]) and change["seconds"] is None:
            change["seconds"] = round(max(0.0, h.get("at", 0.0) - change["at"]), 3)
    return out
