"""`task.agent` processes (`python -m services.scheduler.agent_worker`): each runs the user's agent for
many trajectories at once, answering each run by trajectory id. A run that raises, returns nonsense,
outlives `task.agent_timeout_s` or loses its process fails only its trajectory (`agent_error`,
`agent_invalid`, `agent_timeout`, `agent_crashed`); a dead process is replaced at the next run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import zlib
from typing import Any

from services.scheduler.plugin_worker import to_score
from services.scheduler.plugins import LOAD_TIMEOUT_S, PluginFailure, PluginLoadError

AgentOutcome = float | None | PluginFailure
"""A run's reward, None (`task.reward` scores it), or why it has none."""


class AgentProcess:
    def __init__(self, ref: str, plugin_paths: list[str]):
        self.ref, self.plugin_paths = ref, plugin_paths
        self.env: dict[str, str] = {}
        """Added to the process's environment (the endpoint's trust bundle, with HTTPS)."""
        self.proc: asyncio.subprocess.Process | None = None
        self.runs: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Raises PluginLoadError when the agent cannot be loaded."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.scheduler.agent_worker",
            self.ref,
            *self.plugin_paths,
            env={**os.environ, **self.env},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * 1024 * 1024,
        )
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), LOAD_TIMEOUT_S)
            hello = json.loads(line) if line else {"error": "the process exited while loading"}
        except TimeoutError:
            hello = {"error": f"no answer within {LOAD_TIMEOUT_S:g} s"}
        if not hello.get("ready"):
            await self.kill()
            raise PluginLoadError(f"task.agent {self.ref!r} cannot be loaded: {hello.get('error')}")
        self.reader = asyncio.create_task(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                answer = json.loads(line)
                future = self.runs.pop(str(answer["id"]), None)
                if future is not None and not future.done():
                    future.set_result(answer)
        for future in self.runs.values():  # the process died with these runs in it
            if not future.done():
                future.set_result({"crashed": "the agent process died"})
        self.runs.clear()

    @property
    def alive(self) -> bool:
        return (
            self.proc is not None
            and self.proc.returncode is None
            and self.reader is not None
            and not self.reader.done()
        )

    async def run(self, trajectory_id: str, request: dict[str, Any], timeout_s: float) -> AgentOutcome:
        if not self.alive:
            try:
                await self.start()
            except PluginLoadError as e:  # it loaded before; a restart that cannot is a crash
                return PluginFailure("agent_crashed", str(e))
        assert self.proc is not None and self.proc.stdin is not None
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.runs[trajectory_id] = future
        try:
            self._send({"op": "run", "id": trajectory_id, **request})
            await self.proc.stdin.drain()
            answer = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            self.cancel(trajectory_id)
            return PluginFailure("agent_timeout", f"the agent did not return within {timeout_s:g} s")
        except (ConnectionError, BrokenPipeError) as e:
            self.runs.pop(trajectory_id, None)
            return PluginFailure("agent_crashed", f"the agent process died: {e}")
        return outcome_of(answer)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj, default=str).encode() + b"\n")

    def cancel(self, trajectory_id: str) -> None:
        """Stops the trajectory's run (its answer, if one still comes, is dropped)."""
        future = self.runs.pop(trajectory_id, None)
        if future is not None and not future.done():
            future.set_result({"cancelled": "the trajectory ended first"})
        if self.alive:
            with contextlib.suppress(ConnectionError, BrokenPipeError):
                self._send({"op": "cancel", "id": trajectory_id})

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            await self.reader
            self.reader = None


async def check_agent(ref: str, plugin_paths: list[str]) -> None:
    """Loads the agent once, as the scheduler will; PluginLoadError if it cannot be."""
    process = AgentProcess(ref, list(plugin_paths))
    try:
        await process.start()
    finally:
        await process.kill()


def find_agent(ref: str, plugin_paths: list[str]) -> None:
    """That a sandboxed agent's module is there, without running any of it outside the sandbox
    (its top-level package is looked up, not imported); PluginLoadError if it is not."""
    import importlib.machinery

    top = ref.partition(":")[0].split(".")[0]
    search = [os.path.abspath(p) for p in plugin_paths] + sys.path
    if importlib.machinery.PathFinder.find_spec(top, search) is None:
        raise PluginLoadError(
            f"task.agent {ref!r}: no module {top!r} in task.plugin_paths {plugin_paths} or the installed packages"
        )


class AgentPool:
    """`task.env_workers` agent processes; a trajectory's run stays on one (by its id)."""

    def __init__(self, ref: str, plugin_paths: list[str], workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.workers = [AgentProcess(ref, list(plugin_paths)) for _ in range(workers)]

    def _of(self, trajectory_id: str) -> AgentProcess:
        return self.workers[zlib.crc32(trajectory_id.encode()) % len(self.workers)]

    async def start(self, env: dict[str, str] | None = None) -> None:
        """`env`: added to every agent process's environment."""
        for w in self.workers:
            w.env = dict(env or {})
            await w.start()

    async def run(
        self, trajectory_id: str, sample: dict[str, Any], base_url: str, api_key: str
    ) -> AgentOutcome:
        request = {"sample": sample, "base_url": base_url, "api_key": api_key}
        return await self._of(trajectory_id).run(trajectory_id, request, self.timeout_s)

    def cancel(self, trajectory_id: str) -> None:
        self._of(trajectory_id).cancel(trajectory_id)

    async def close(self) -> None:
        for w in self.workers:
            await w.kill()


class CommandAgents:
    """`task.agent_command`: one process per trajectory running the user's own command (any
    language, any framework), pointed at the endpoint the way OpenAI clients read it:
    `OPENAI_BASE_URL` and `OPENAI_API_KEY` (with `LIBRA_TRAJECTORY_ID`), the dataset row as JSON in
    `LIBRA_SAMPLE` and on stdin. Its reward is the last line it prints: a number, `{"reward": x}`,
    or `null` (or no output at all) for `task.reward` to score it. The service's own `LIBRA_*` settings are not
    passed on. Its working directory is `task.plugin_paths[0]` when set."""

    def __init__(self, command: list[str], plugin_paths: list[str], timeout_s: float):
        self.command, self.timeout_s = list(command), timeout_s
        self.cwd = plugin_paths[0] if plugin_paths else None
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.env: dict[str, str] = {}

    async def start(self, env: dict[str, str] | None = None) -> None:
        """Raises PluginLoadError when the command's program cannot be found. `env`: added to
        every run's environment."""
        check_command(self.command, self.cwd)
        self.env = dict(env or {})

    async def run(
        self, trajectory_id: str, sample: dict[str, Any], base_url: str, api_key: str
    ) -> AgentOutcome:
        row = json.dumps(sample, default=str)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
        env |= self.env | command_env(base_url, api_key, trajectory_id, row)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                cwd=self.cwd,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            return PluginFailure("agent_crashed", f"the agent command could not start: {e}")
        self.procs[trajectory_id] = proc
        try:
            out, err = await asyncio.wait_for(proc.communicate(row.encode() + b"\n"), self.timeout_s)
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            return PluginFailure(
                "agent_timeout", f"the agent command did not exit within {self.timeout_s:g} s"
            )
        finally:
            self.procs.pop(trajectory_id, None)
        return command_outcome(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    def cancel(self, trajectory_id: str) -> None:
        proc = self.procs.pop(trajectory_id, None)
        if proc is not None:
            _kill(proc)

    async def close(self) -> None:
        for trajectory_id in list(self.procs):
            self.cancel(trajectory_id)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """The command and whatever it started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def outcome_of(answer: dict[str, Any]) -> AgentOutcome:
    """A run's outcome from its agent process's answer (services/scheduler/agent_worker.py)."""
    if "cancelled" in answer:
        return PluginFailure("agent_cancelled", str(answer["cancelled"]))
    if "crashed" in answer:
        return PluginFailure("agent_crashed", str(answer["crashed"])[:500])
    if "error" in answer:
        return PluginFailure("agent_error", str(answer["error"])[:500])
    if "invalid" in answer:
        return PluginFailure("agent_invalid", f"returned {str(answer['invalid'])[:500]}")
    if isinstance(command := answer.get("command"), dict):  # a command run in the tool sandbox
        code = command.get("code")
        if not isinstance(code, int):
            return PluginFailure("agent_crashed", "the sandboxed command's answer has no exit code")
        return command_outcome(code, str(command.get("stdout", "")), str(command.get("stderr", "")))
    score = to_score(answer.get("ok")) if answer.get("ok") is not None else None
    if isinstance(score, str):  # an answer that is not the worker's own
        return PluginFailure("agent_invalid", f"its answer {score}")
    return score


def command_env(base_url: str, api_key: str, trajectory_id: str, row: str) -> dict[str, str]:
    """What a command agent's environment says of its run, beside the scheduler or in the
    sandbox: the endpoint and key as OpenAI clients read them, the trajectory, the row (JSON)."""
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "LIBRA_TRAJECTORY_ID": trajectory_id,
        "LIBRA_SAMPLE": row,
    }


def command_outcome(code: int, stdout: str, stderr: str) -> AgentOutcome:
    """A command agent's outcome from how it exited and what it printed."""
    if code != 0:
        why = f"killed by signal {-code}" if code < 0 else f"exited {code}"
        return PluginFailure("agent_error", f"the agent command {why}: {stderr.strip()[-400:]}")
    return reward_of(stdout)


def reward_of(stdout: str) -> AgentOutcome:
    """A command agent's reward: its last printed line."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines or lines[-1] == "null":
        return None
    last = lines[-1]
    try:
        value = json.loads(last)
    except json.JSONDecodeError:
        return PluginFailure("agent_invalid", f"its last line is not a reward: {last[:200]!r}")
    if isinstance(value, dict):
        value = value.get("reward")
        if value is None:
            return None
    score = to_score(value)
    return PluginFailure("agent_invalid", f"its last line {score}") if isinstance(score, str) else score


def check_command(command: list[str], cwd: str | None) -> None:
    """PluginLoadError unless the command's program exists (on PATH, or as a path from `cwd`)."""
    program = command[0]
    found = shutil.which(program) or shutil.which(program, path=cwd or None)
    if found is None and not (cwd and os.access(os.path.join(cwd, program), os.X_OK)):
        raise PluginLoadError(f"task.agent_command {command!r}: no program {program!r} on PATH or in {cwd}")
