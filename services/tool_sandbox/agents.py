"""`task.agent_sandbox`: the job's agent, run once per trajectory in a sandbox of its own.

The sandbox is the tool sandbox's (services/tool_sandbox/isolation.py: fresh namespaces, no
network, read-only /usr, a size-capped scratch) with the agent's own limits, Libra's code, this
service's packages and the job's plugin paths mounted read-only, and one Unix socket: the endpoint.
Inside, `services.scheduler.agent_worker.sandboxed` serves a loopback relay to that socket and runs
the agent against it; here, an `EndpointBridge` carries each connection on to the scheduler's
endpoint (HTTPS verified with the stack's CA beyond loopback). One trajectory's sandbox never sees
another's socket, key or files.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import site
import ssl
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

import services
from services.common.contracts import ev
from services.common.errors import InvalidMessage
from services.common.tls import is_loopback
from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.isolation import (
    SCRATCH,
    ProcessResult,
    SandboxProcess,
    bwrap_argv,
    host_credentials,
    reachable_bwrap,
)
from services.tool_sandbox.outcome import EXIT_MEMORY_LIMIT

log = structlog.get_logger()

CODE_DIR = "/opt/libra"
"""Where Libra's `services` package is mounted in an agent's sandbox."""
ENDPOINT_DIR = "/libra-endpoint"
"""Where the directory holding the endpoint's socket is mounted in an agent's sandbox."""
SOCKET = "endpoint.sock"
BOOT = (
    "import json, site, sys\n"
    "spec = json.loads(sys.argv[1])\n"
    "sys.path.insert(0, spec['code'])\n"
    "for d in spec['sites']:\n"
    "    site.addsitedir(d)\n"
    "from services.scheduler.agent_worker import sandboxed\n"
    "sys.exit(sandboxed(spec))\n"
)
"""What the sandbox's interpreter runs (`-I -S`: nothing of the environment, no site-packages but
the service's own, added here)."""
SNAPSHOT_BYTES = 256 << 20
"""The most of one plugin path a sandbox running as another uid gets a copy of."""


def agent_settings(settings: SandboxSettings) -> SandboxSettings:
    """The sandbox's settings with an agent's interpreter and limits in place of a tool's."""
    return settings.model_copy(
        update={
            "python_executable": settings.agent_python,
            "python_flags": ["-I", "-S"],
            "memory_bytes": settings.agent_memory_bytes,
            "max_processes": settings.agent_max_processes,
            "max_open_files": settings.agent_max_open_files,
            "cpu_time_s": settings.agent_cpu_time_s,
        }
    )


def site_dirs() -> list[str]:
    """This service's package directories outside /usr (which every sandbox mounts anyway)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d) and not d.startswith("/usr/")]


@dataclass(frozen=True)
class AgentJob:
    """The job's agent, from its config: the sandbox runs this and nothing a request names."""

    ref: str | None
    """`task.agent` (module:function), or None for a command."""
    plugin_paths: list[str] = field(default_factory=list)
    command: list[str] | None = None
    """`task.agent_command`."""

    @property
    def paths(self) -> list[str]:
        return [p for p in (os.path.abspath(p) for p in self.plugin_paths) if os.path.isdir(p)]

    def mounts(self) -> dict[str, str]:
        """Inside the sandbox → here: Libra's code, this service's packages and the job's plugin
        paths, each at a fixed place (so that nothing of this host's layout shows, and /tmp stays
        the sandbox's own scratch)."""
        out = {f"{CODE_DIR}/services": str(Path(services.__file__).parent)}
        out |= {f"{CODE_DIR}/site/{i}": d for i, d in enumerate(site_dirs())}
        return out | {f"{CODE_DIR}/task/{i}": p for i, p in enumerate(self.paths)}

    def binds(self, endpoint_dir: Path) -> list[str]:
        """The sandbox's mounts beyond a tool's: `mounts` read-only, the endpoint's socket directory."""
        out = [arg for inside, here in self.mounts().items() for arg in ("--ro-bind", here, inside)]
        return [*out, "--bind", str(endpoint_dir), ENDPOINT_DIR]

    def argv(self, python: str) -> list[str]:
        inside = list(self.mounts())
        spec: dict[str, Any] = {"ref": self.ref, "command": self.command, "code": CODE_DIR}
        spec["socket"] = f"{ENDPOINT_DIR}/{SOCKET}"
        spec |= {
            "sites": [p for p in inside if p.startswith(f"{CODE_DIR}/site/")],
            "paths": [p for p in inside if p.startswith(f"{CODE_DIR}/task/")],
        }
        return [python, "-I", "-S", "-c", BOOT, json.dumps(spec)]


class EndpointBridge:
    """A Unix socket whose connections go on to the scheduler's endpoint: plain on loopback, else
    HTTPS verified with the stack's CA (`ca_file`) or the system's trust store."""

    def __init__(self, base_url: str, ca_file: str | None):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise InvalidMessage(f"base_url {base_url[:200]!r} is not an http(s) URL")
        if url.scheme == "http" and not is_loopback(url.hostname):
            raise InvalidMessage(
                f"base_url {base_url[:200]!r}: an endpoint beyond loopback is reached over https only"
            )
        try:
            port = url.port
        except ValueError as e:
            raise InvalidMessage(f"base_url {base_url[:200]!r}: {e}") from None
        self.host = url.hostname
        self.port = port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context(cafile=ca_file) if url.scheme == "https" else None
        self.server: asyncio.Server | None = None
        self.carrying: set[asyncio.Task[None]] = set()

    async def open(self, directory: Path, world: bool) -> None:
        """Listens at `directory`/SOCKET; `world`: anyone may connect (the sandbox runs as another
        uid), else only this one."""
        path = directory / SOCKET
        self.server = await asyncio.start_unix_server(self._connected, path=str(path))
        path.chmod(0o777 if world else 0o700)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.carrying.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None
            )
        except (OSError, ssl.SSLError) as e:
            log.warning("agent_endpoint_unreachable", host=self.host, port=self.port, error=str(e))
            writer.close()
            self.carrying.discard(task)
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self.carrying.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.carrying):
            task.cancel()
        await asyncio.gather(*self.carrying, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ssl.SSLError):
        pass
    finally:
        if reader.at_eof():
            writer.close()


def agent_return(trajectory_id: str, result: ProcessResult, timeout_s: float) -> ev.AgentReturn:
    """How a sandboxed run ended, from what its sandbox left: the agent's answer, or why none."""
    ret = ev.AgentReturn(
        trajectory_id=trajectory_id,
        wall_s=result.wall_s,
        cpu_s=result.cpu_s,
        peak_rss_bytes=result.peak_rss_bytes,
    )
    stderr = result.stderr.decode(errors="replace").strip()[-400:]
    lines = result.stdout.decode(errors="replace").strip().splitlines()
    if result.timed_out:
        ret.failure, ret.message = "agent_timeout", f"the agent did not return within {timeout_s:g} s"
    elif result.output_exceeded:
        ret.failure, ret.message = "agent_error", "the agent printed more than the sandbox keeps"
    elif result.exit_code == 0 and lines and lines[-1].startswith("{"):
        ret.answer_json = lines[-1]
    else:
        why = "its memory limit" if result.exit_code == EXIT_MEMORY_LIMIT else f"exit {result.exit_code}"
        ret.failure, ret.message = (
            "agent_crashed",
            f"the sandboxed agent ended without an answer ({why}): {stderr}",
        )
    return ret


class AgentSandboxes:
    """Runs the job's agent (`job`) for each trajectory asked, `max_agents` at once."""

    def __init__(self, settings: SandboxSettings, job: AgentJob, ca_file: str | None):
        self.base = settings
        self.settings = agent_settings(settings)
        self.job, self.ca_file = job, ca_file
        self.credentials = host_credentials(settings)
        self.slots = asyncio.Semaphore(settings.max_agents)
        self.bwrap = ""
        self.asked: set[str] = set()
        self.running: dict[str, SandboxProcess] = {}
        self.cancelled: set[str] = set()
        self.snapshot: Path | None = None

    async def start(self) -> None:
        self.bwrap = await asyncio.to_thread(reachable_bwrap, self.settings)
        if self.credentials:  # the sandbox runs as another uid: it reads a copy of the job's code
            self.snapshot = Path(tempfile.mkdtemp(prefix="libra-agent-task-"))
            paths = await asyncio.to_thread(readable_copies, self.job.paths, self.snapshot)
            self.job = AgentJob(self.job.ref, paths, self.job.command)

    def holds(self, trajectory_id: str) -> bool:
        """Whether the trajectory's run is here (taken, not yet ended)."""
        return trajectory_id in self.asked

    def accept(self, run: ev.AgentRun) -> EndpointBridge:
        """The run's bridge; InvalidMessage (and nothing started) for a run this sandbox cannot take."""
        if not run.trajectory_id:
            raise InvalidMessage("an agent run names its trajectory")
        if not run.api_key or not run.timeout_s > 0:
            raise InvalidMessage("an agent run carries its trajectory's key and a positive timeout")
        try:
            sample = json.loads(run.sample_json or "{}")
        except ValueError as e:
            raise InvalidMessage(f"sample_json is not JSON: {e}") from None
        if not isinstance(sample, dict):
            raise InvalidMessage("sample_json is not a JSON object")
        bridge = EndpointBridge(run.base_url, self.ca_file)
        self.asked.add(run.trajectory_id)
        return bridge

    async def run(self, run: ev.AgentRun, bridge: EndpointBridge) -> ev.AgentReturn:
        tid = run.trajectory_id
        try:
            async with self.slots:
                if tid in self.cancelled:
                    return ev.AgentReturn(trajectory_id=tid, failure="agent_cancelled", message="cancelled")
                return await self._run(run, bridge)
        finally:
            self.asked.discard(tid)
            self.cancelled.discard(tid)

    async def _run(self, run: ev.AgentRun, bridge: EndpointBridge) -> ev.AgentReturn:
        tid = run.trajectory_id
        directory = Path(tempfile.mkdtemp(prefix="libra-agent-"))
        directory.chmod(0o755 if self.credentials else 0o700)
        started = time.perf_counter()
        try:
            await bridge.open(directory, world=bool(self.credentials))
            argv = bwrap_argv(self.settings, self.bwrap, self.job.binds(directory))
            proc = SandboxProcess.spawn(argv, self.credentials)
            self.running[tid] = proc
            request: dict[str, Any] = {
                "kind": "exec",
                "argv": self.job.argv(self.settings.python_executable),
                "stdin": json.dumps(
                    {"id": tid, "sample": json.loads(run.sample_json or "{}"), "api_key": run.api_key}
                ),
                "env": {"HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"},
            }
            result = await proc.run(
                request,
                timeout_s=run.timeout_s,
                cpu_s=self.settings.cpu_time_s,
                output_limit=self.base.max_output_bytes,
            )
        except OSError as e:
            log.error("agent_sandbox_failed", trajectory_id=tid, error=str(e))
            return ev.AgentReturn(
                trajectory_id=tid,
                failure="agent_crashed",
                message=f"the sandbox could not start: {e}",
                wall_s=time.perf_counter() - started,
            )
        finally:
            self.running.pop(tid, None)
            await bridge.close()
            shutil.rmtree(directory, ignore_errors=True)
        if tid in self.cancelled:
            return ev.AgentReturn(trajectory_id=tid, failure="agent_cancelled", message="cancelled")
        return agent_return(tid, result, run.timeout_s)

    def cancel(self, trajectory_id: str) -> None:
        """Kills the trajectory's run if it is here (its sandbox, and everything in it)."""
        if trajectory_id not in self.asked:
            return
        self.cancelled.add(trajectory_id)
        proc = self.running.get(trajectory_id)
        if proc is not None:
            proc.kill()

    async def close(self) -> None:
        for trajectory_id in list(self.running):
            self.cancel(trajectory_id)
        if self.snapshot is not None:
            shutil.rmtree(self.snapshot, ignore_errors=True)


def readable_copies(paths: list[str], into: Path) -> list[str]:
    """Copies of `paths` under `into` that any uid may read (not write), as they are now; a path
    over SNAPSHOT_BYTES is refused (RuntimeError): the job's plugin paths hold code, not data."""
    into.chmod(0o755)
    out = []
    for i, path in enumerate(paths):
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        if size > SNAPSHOT_BYTES:
            raise RuntimeError(
                f"task.plugin_paths {path} holds {size >> 20} MiB: a sandboxed agent reads a copy of it, "
                f"at most {SNAPSHOT_BYTES >> 20} MiB (keep data out of the plugin path)"
            )
        target = into / str(i)
        shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", ".git"))
        for f in [target, *target.rglob("*")]:
            f.chmod(0o755 if f.is_dir() or os.access(f, os.X_OK) else 0o644)
        out.append(str(target))
    return out
