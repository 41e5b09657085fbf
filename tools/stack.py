"""Supervises a local Libra stack: the embedded nats-server and Redis-compatible server, and the
five services as separate OS processes, idle until a job is submitted over the control plane
(services/common/control.py). `libra up`, `libra run` and the e2e tests all use it, and the container
images run the very same `python -m services.<name>` commands."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.credentials import NatsAuth, StackCredentials
from services.common.credentials import generate as generate_credentials
from services.common.localstack import Server, die_with_parent, free_port, start_nats, start_redis

if TYPE_CHECKING:
    import ssl

    from services.common.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """`.libra/` of the directory Libra is started in (like `runs/`): the stack file, the embedded
    servers' data and credentials, and the default model cache (`model.cache_dir`)."""
    return Path.cwd() / ".libra"


def stack_file() -> Path:
    """Where `libra up` records its stack: `.libra/stack.json` of the directory it starts in."""
    return state_dir() / "stack.json"


def stack_files() -> list[Path]:
    """The stack files `libra run`, `status` and `down` look for, nearest first: the one of the
    directory they start in, then of each directory above it (as git finds its repository), so a
    job started in a sub-directory of a project runs on the project's stack instead of starting a
    second one."""
    return [d / ".libra" / "stack.json" for d in (Path.cwd(), *Path.cwd().parents)]


NATS_LOG = "nats-server.log"
HOST = "engine-host"
HOST_MODULE = "services.rollout_engine.host"
_VIOLATION = re.compile(r'"\$G/user:([^"]+)" - (Publish|Subscription) Violation')


def service_commands(
    n_engines: int, standby_trainers: int = 0, standby_schedulers: int = 0
) -> list[tuple[str, str]]:
    """(worker id, module) for every process of a stack, in start order."""
    cmds = [("planner", "services.planner"), ("tool-sandbox", "services.tool_sandbox")]
    cmds += [(f"rollout-engine-{i}", "services.rollout_engine") for i in range(n_engines)]
    cmds += [("trainer", "services.trainer")]
    cmds += [(f"trainer-standby-{i}", "services.trainer") for i in range(standby_trainers)]
    cmds += [("scheduler", "services.scheduler")]
    cmds += [(f"scheduler-standby-{i}", "services.scheduler") for i in range(standby_schedulers)]
    return cmds


CALLER_SECRETS = (
    "LIBRA_SECRETS_DIR",
    "LIBRA_NATS_USER",
    "LIBRA_NATS_PASSWORD",
    "LIBRA_REDIS_PASSWORD",
    "LIBRA_WEIGHT_SYNC_TOKEN",
)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Stack:
    name: str
    log_dir: Path
    otlp_endpoint: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    nats: Server | None = None
    redis: Server | None = None
    nats_url: str = ""
    redis_url: str = ""
    credentials: StackCredentials | None = None
    """Where this stack's secrets are (services/common/credentials.py); None: no auth (tests)."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    """Services of a stack another process supervises (`libra up`), watched by pid only."""
    max_restarts: int = 5
    """Restarts of one service before the stack gives up on it (0: never restart)."""
    restarts: dict[str, int] = field(default_factory=dict)
    gave_up: dict[str, int | None] = field(default_factory=dict)
    """Services that died once too often (or with restarts off), with their last exit code."""
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Each service's Prometheus port on loopback (kept across its restarts)."""
    tls: TlsFiles | None = None
    """The CA (and client certificate) that the stack's NATS and engines' WeightSync are verified
    with, for a remote stack that serves TLS (`libra run --tls-ca-file`)."""
    remote: bool = False
    """Reached over the network only: no pids, no local logs (`Stack.reached_at`)."""
    cwd: Path = field(default_factory=Path.cwd)
    """Where the services start (the directory of `libra up`/`libra run`): their `.libra/` model
    cache is this directory's."""
    engines_per_host: int = 1
    """Emulated engines served by one process (services/rollout_engine/host.py): above 1, the
    engines run in hosts `engine-host-<n>` of this many identities each, so that hundreds of
    them fit one machine (`libra bench live --engines-per-host`)."""
    _modules: dict[str, str] = field(default_factory=dict)
    _hosts: dict[str, list[str]] = field(default_factory=dict)
    """Each engine host's process name and the engine worker ids it serves."""
    _due: dict[str, float] = field(default_factory=dict)

    @classmethod
    def attach(cls, state: dict[str, object]) -> Stack:
        """The stack `libra up` described in its stack file: used, never stopped, by this process."""
        services = state.get("services")
        restarts, gave_up = state.get("restarts"), state.get("gave_up")
        metrics = state.get("metrics_ports")
        return cls(
            name=str(state["name"]),
            log_dir=Path(str(state["logs"])),
            nats_url=str(state["nats_url"]),
            redis_url=str(state["redis_url"]),
            credentials=StackCredentials(Path(str(state["secrets"]))) if state.get("secrets") else None,
            pids={str(k): int(v) for k, v in services.items()} if isinstance(services, dict) else {},
            restarts={str(k): int(v) for k, v in restarts.items()} if isinstance(restarts, dict) else {},
            gave_up=dict(gave_up) if isinstance(gave_up, dict) else {},
            metrics_ports={str(k): int(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {},
        )

    @classmethod
    def reached_at(
        cls, nats_url: str, redis_url: str, secrets: Path | None, log_dir: Path, tls: TlsFiles | None = None
    ) -> Stack:
        """A stack this machine only reaches (compose, Kubernetes, other hosts): its services are
        watched through their heartbeats, `secrets` holds the `cli` identity's credentials
        (`<secrets>/cli/`, as `libra credentials` writes them), `tls` verifies its servers."""
        if secrets is not None and not (secrets / "cli").is_dir():
            raise FileNotFoundError(f"--secrets {secrets}: no cli/ credentials in it")
        return cls(
            name=f"remote {nats_url}",
            log_dir=log_dir,
            nats_url=nats_url,
            redis_url=redis_url,
            credentials=StackCredentials(secrets) if secrets is not None else None,
            max_restarts=0,
            remote=True,
            tls=tls,
        )

    def refresh(self) -> None:
        """An attached stack re-reads the supervisor's file: restarted services have new pids."""
        state = read_stack_file()
        if self.procs or state is None or state.get("name") != self.name:
            return
        fresh = Stack.attach(state)
        self.pids, self.restarts, self.gave_up = fresh.pids, fresh.restarts, fresh.gave_up

    def start_infra(self, n_engines: int, standby_trainers: int = 0, standby_schedulers: int = 0) -> None:
        """Generates the credentials of a stack of `n_engines` engines (an identity per worker)
        and starts nats-server (a user per worker, allowed what its role needs) and Redis (an ACL
        user per worker) on free loopback ports; `start_services` then starts its workers."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        data = state_dir() / "data" / self.name
        self.plan_processes(n_engines, standby_trainers, standby_schedulers)
        self.credentials = generate_credentials(data / "secrets", workers=list(self._modules))
        self.nats = start_nats(data / "nats", self.log_dir / NATS_LOG, config=self.credentials.nats_conf)
        self.redis = start_redis(
            data / "redis", self.log_dir / "redis-server.log", config=self.credentials.redis_conf
        )
        self.nats_url, self.redis_url = self.nats.url, self.redis.url

    def nats_auth(self, identity: str = "cli") -> NatsAuth | None:
        return self.credentials.nats_auth(identity) if self.credentials else None

    def redis_auth(self, identity: str = "cli") -> dict[str, str]:
        """redis-py's username and password of `identity` (empty without credentials)."""
        return self.credentials.redis_auth(identity) if self.credentials else {}

    def nats_tls(self) -> ssl.SSLContext | None:
        return self.tls.client_ssl() if self.tls is not None else None

    def grpc_token(self) -> str | None:
        return self.credentials.weight_sync_token() if self.credentials else None

    def env(self, worker_id: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "LIBRA_NATS_URL": self.nats_url,
                "LIBRA_REDIS_URL": self.redis_url,
                "LIBRA_WORKER_ID": worker_id,
                "LIBRA_LOG_FORMAT": "json",
                "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": str(ROOT),
            }
        )
        if self.otlp_endpoint:
            env["LIBRA_OTLP_ENDPOINT"] = self.otlp_endpoint
        for name in CALLER_SECRETS:  # never the caller's: each service gets only its own
            env.pop(name, None)
        if self.credentials is not None:
            env["LIBRA_SECRETS_DIR"] = str(self.credentials.identity_dir(worker_id))
        env.pop("LIBRA_CONFIG", None)  # no pinned job: the services wait for jobs on the control plane
        env.pop("LIBRA_RUN_ID", None)
        if worker_id in self.metrics_ports:
            env["LIBRA_METRICS_PORT"] = str(self.metrics_ports[worker_id])
        env.update(self.extra_env)
        return env

    def plan_processes(self, n_engines: int, standby_trainers: int = 0, standby_schedulers: int = 0) -> None:
        """The workers of a stack of `n_engines` engines, and the engine hosts that serve them."""
        for worker_id, module in service_commands(n_engines, standby_trainers, standby_schedulers):
            self._modules[worker_id] = module
        if self.engines_per_host > 1:
            engines = [w for w in self._modules if w.startswith("rollout-engine-")]
            k = self.engines_per_host
            self._hosts = {f"{HOST}-{i // k}": engines[i : i + k] for i in range(0, len(engines), k)}

    def processes(self) -> list[str]:
        """The stack's service processes in start order: a worker each, or an engine host for each
        `engines_per_host` engines."""
        hosted = {w for ws in self._hosts.values() for w in ws}
        out: list[str] = []
        for worker_id in self._modules:
            if worker_id not in hosted:
                out.append(worker_id)
            elif worker_id == self._hosts[self.process_of(worker_id)][0]:
                out.append(self.process_of(worker_id))
        return out

    def process_of(self, worker_id: str) -> str:
        """The process that serves `worker_id`: its own, or its engine host."""
        return next((h for h, ws in self._hosts.items() if worker_id in ws), worker_id)

    def start_services(self) -> None:
        for name in self.processes():
            self.metrics_ports.setdefault(name, free_port())
            self._spawn(name)

    def _host_env(self, name: str) -> dict[str, str]:
        env = self.env(name)
        env.pop("LIBRA_SECRETS_DIR", None)
        env.pop("LIBRA_WORKER_ID")
        env["LIBRA_ENGINE_HOST_WORKERS"] = ",".join(self._hosts[name])
        env["LIBRA_ENGINE_HOST_NAME"] = name
        if self.credentials is not None:
            env["LIBRA_ENGINE_HOST_SECRETS_ROOT"] = str(self.credentials.root)
        return env

    def _spawn(self, name: str) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        hosted = name in self._hosts
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", HOST_MODULE if hosted else self._modules[name]],
            cwd=self.cwd,
            env=self._host_env(name) if hosted else self.env(name),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def supervise(self) -> list[str]:
        """Restarts services that died, after a backoff of 1, 2, 4, … s (at most 30 s), up to
        `max_restarts` times each, as compose's restart policy and Kubernetes do. Returns the
        services restarted by this call; those it gave up on are in `gave_up`."""
        restarted = self._supervise_infra()
        now = time.monotonic()
        for name, p in list(self.procs.items()):
            code = p.poll()
            if code is None or name in self.gave_up:
                continue
            n = self.restarts.get(name, 0)
            if n >= self.max_restarts:
                self.gave_up[name] = code
                continue
            due = self._due.setdefault(name, now + min(30.0, 2.0**n))
            if now < due:
                continue
            self._due.pop(name)
            self.restarts[name] = n + 1
            self._spawn(name)
            restarted.append(name)
        return restarted

    def kill(self, worker_id: str) -> bool:
        """SIGKILLs a service that is hung (alive, but silent past its liveness timeout) where a
        supervisor will start it again: this stack's (restarts on), or `libra up`'s, which this
        stack follows. False where nothing would replace it (restarts off, given up, reached only)."""
        worker_id = self.process_of(worker_id)  # an engine's host: all of its engines go
        if worker_id in self.gave_up:
            return False
        proc = self.procs.get(worker_id)
        if proc is not None:
            if self.max_restarts <= 0 or self.restarts.get(worker_id, 0) >= self.max_restarts:
                return False
            if proc.poll() is None:
                proc.kill()
            return True
        pid = self.pids.get(worker_id)
        if pid is None or self.remote or read_stack_file() is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def _supervise_infra(self) -> list[str]:
        """nats-server and Redis come back at once on the same port, data and credentials (every
        service waits on them); their restarts count like a service's."""
        restarted = []
        for srv in (self.nats, self.redis):
            if srv is None or srv.proc.poll() is None:
                continue
            name = f"{srv.name}-server"
            n = self.restarts.get(name, 0)
            if name in self.gave_up:
                continue
            if n >= self.max_restarts:
                self.gave_up[name] = srv.proc.returncode
                continue
            self.restarts[name] = n + 1
            try:
                srv.restart()
            except (OSError, TimeoutError):
                self.gave_up[name] = srv.proc.poll()
                continue
            restarted.append(name)
        return restarted

    def engines(self) -> set[str] | None:
        """The worker ids of the rollout engines this stack runs; None where it does not know
        (a stack reached by its endpoints, whose services run elsewhere)."""
        names = set(self._modules) or set(self.pids)
        return {n for n in names if n.startswith("rollout-engine")} if names else None

    def of_kind(self, kind: str) -> set[str]:
        """The worker ids of the `kind` services this stack runs (a trainer or a scheduler: the
        active one and its standbys)."""
        names = set(self._modules) or set(self.pids)
        return {n for n in names if n == kind or n.startswith(f"{kind}-")}

    def dead(self) -> dict[str, int | None]:
        """Services that exited and stay down: all of them without supervision, else those the
        supervisor gave up on (exit code None when another process supervises them)."""
        if self.pids:
            out: dict[str, int | None] = dict(self.gave_up)
            if not read_stack_file():  # the supervisor itself is gone
                out.update({n: None for n, pid in self.pids.items() if not pid_alive(pid)})
            return out
        if self.max_restarts > 0:
            return self._by_worker(self.gave_up)
        return self._by_worker({n: p.returncode for n, p in self.procs.items() if p.poll() is not None})

    def worker_restarts(self) -> dict[str, int]:
        """Restarts by worker: an engine host's count for each of its engines."""
        return {w: n for name, n in self.restarts.items() for w in self._hosts.get(name, [name])}

    def _by_worker(self, processes: dict[str, int | None]) -> dict[str, int | None]:
        """Processes by the workers they served: a dead engine host is each of its engines."""
        out: dict[str, int | None] = {}
        for name, code in processes.items():
            out.update({w: code for w in self._hosts.get(name, [name])})
        return out

    def nats_log_size(self) -> int | None:
        """Where nats-server's log ends now (`nats_violations` counts from there); None where this
        machine does not have it (a remote stack)."""
        path = self.log_dir / NATS_LOG
        if self.remote or not path.exists():
            return None
        return path.stat().st_size

    def nats_violations(self, since: int | None) -> dict[str, dict[str, int]] | None:
        """Publishes and subscriptions nats-server refused, by NATS user, since log offset
        `since` (its log: `... "$G/user:rollout-engine-1" - Publish Violation - Subject ...`)."""
        path = self.log_dir / NATS_LOG
        if since is None or not path.exists():
            return None
        with path.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        out: dict[str, dict[str, int]] = {}
        for user, what in _VIOLATION.findall(text):
            by = out.setdefault(user, {})
            by[what.lower()] = by.get(what.lower(), 0) + 1
        return out

    def log_tail(self, worker_id: str, lines: int = 20) -> str:
        path = self.log_dir / f"{self.process_of(worker_id)}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every service (they drain), SIGKILL what is left after `grace_s`, then the infra."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for srv in (self.nats, self.redis):
            if srv is not None:
                srv.stop()

    def state(self) -> dict[str, object]:
        infra = {s.name: s.proc.pid for s in (self.nats, self.redis) if s is not None}
        return {
            "name": self.name,
            "nats_url": self.nats_url,
            "redis_url": self.redis_url,
            "secrets": str(self.credentials.root) if self.credentials else None,
            "supervisor_pid": os.getpid(),
            "services": {n: p.pid for n, p in self.procs.items()},
            "metrics_ports": dict(self.metrics_ports),
            "restarts": dict(self.restarts),
            "gave_up": dict(self.gave_up),
            "infra": infra,
            "logs": str(self.log_dir),
            "started_at": time.time(),
        }


def read_stack_file() -> dict[str, object] | None:
    """The nearest running stack of `stack_files` (its `stack_file` key: where it was found), or
    None; a file left by a supervisor that is gone is removed and the search goes on above it."""
    for path in stack_files():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        pid = data.get("supervisor_pid")
        if isinstance(pid, int) and pid_alive(pid):
            return {**data, "stack_file": str(path)}
        with contextlib.suppress(OSError):  # left by a supervisor killed (-9): its children are gone
            path.unlink()
    return None
