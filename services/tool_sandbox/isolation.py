"""bubblewrap-based isolation: how one sandbox is built, started, fed a request, bounded and reaped.

A sandbox is one `bwrap` process tree in fresh user, pid, network, ipc, uts and cgroup namespaces,
running as an unprivileged host uid, over a read-only view of /usr and a size-capped tmpfs scratch.
Inside, a small Python runner applies rlimits, blocks until the host sends one JSON request on
stdin, then runs the snippet (or execs a command). Started ahead of time it is a warm sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.outcome import EXIT_FILE_LIMIT, EXIT_MEMORY_LIMIT
from services.tool_sandbox.proc_io import CLOCK_TICKS, OutputCapture, children, descendants, resolve

log = structlog.get_logger()

SCRATCH = "/scratch"
_PR_SET_CHILD_SUBREAPER = 36

RUNNER = f"""
import atexit, os, resource, sys
for _spec in sys.argv[1].split():
    _n, _soft, _hard = _spec.split(":")
    resource.setrlimit(getattr(resource, _n), (int(_soft), int(_hard)))
_ufd = int(sys.argv[2])
os.set_inheritable(_ufd, False)
_kind, _, _cpu = sys.stdin.buffer.readline().decode().partition(" ")
if not _kind:
    os._exit(0)
_body = sys.stdin.buffer.read()
_u0 = resource.getrusage(resource.RUSAGE_SELF)
def _usage():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime - _u0.ru_utime - _u0.ru_stime
    try:
        os.write(_ufd, f"{{cpu}} {{max(s.ru_maxrss, c.ru_maxrss) * 1024}}".encode())
    except OSError:
        pass
atexit.register(_usage)
_fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(_fd, 0)
os.close(_fd)
_cpu = min(int(_cpu), resource.getrlimit(resource.RLIMIT_CPU)[0])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
if _kind == "exec":
    import json
    _req = json.loads(_body)
    if _req.get("stdin"):
        with open("{SCRATCH}/.stdin", "w") as _f:
            _f.write(_req["stdin"])
        _fd = os.open("{SCRATCH}/.stdin", os.O_RDONLY)
        os.unlink("{SCRATCH}/.stdin")
        os.dup2(_fd, 0)
        os.close(_fd)
    _env = {{"PATH": os.environ["PATH"], **_req.get("env", {{}})}}
    _st = os.waitpid(os.posix_spawn(_req["argv"][0], _req["argv"], _env), 0)[1]
    _code = os.waitstatus_to_exitcode(_st)
    sys.exit(128 - _code if _code < 0 else _code)
sys.argv = ["-c"]
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
try:
    exec(compile(_body, "<snippet>", "exec"), _g)
except SystemExit:
    raise
except MemoryError:
    _g.clear()
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os.write(2, b"MemoryError: memory limit exceeded\\n")
    _usage()
    os._exit({EXIT_MEMORY_LIMIT})
except BaseException as _e:
    import errno, traceback
    _limit = isinstance(_e, OSError) and _e.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.stdout.flush()
    sys.exit({EXIT_FILE_LIMIT} if _limit else 1)
"""


@dataclass(slots=True)
class ProcessResult:
    """How one sandboxed request ended, as observed from the host."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_exceeded: bool
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int


def rlimits(settings: SandboxSettings) -> dict[str, tuple[int, int]]:
    """The per-process limits the runner applies before it reads untrusted input."""
    return {
        "RLIMIT_CPU": (settings.cpu_time_s, settings.cpu_time_s + 1),
        "RLIMIT_AS": (settings.memory_bytes, settings.memory_bytes),
        "RLIMIT_NPROC": (settings.max_processes, settings.max_processes),
        "RLIMIT_FSIZE": (settings.max_file_bytes, settings.max_file_bytes),
        "RLIMIT_NOFILE": (settings.max_open_files, settings.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }


def _root_layout() -> list[str]:
    """Mirror the host's /bin, /lib* and /sbin (symlinks on merged-/usr systems) over a read-only /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def bwrap_argv(settings: SandboxSettings, bwrap: str, binds: list[str] | None = None) -> list[str]:
    """The full command line of one sandbox; every isolation property is visible here. `binds`:
    more bubblewrap mounts (a sandboxed agent's code and packages, read-only, and its endpoint)."""
    python = os.path.realpath(settings.python_executable)
    argv = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        *_root_layout(),
    ]
    if not python.startswith("/usr/"):
        prefix = str(Path(python).parent.parent)
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        *(binds or []),
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(settings.scratch_bytes),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(settings.scratch_bytes),
        "--tmpfs",
        SCRATCH,
        "--symlink",
        SCRATCH.lstrip("/"),
        "/tmp",
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        SCRATCH,
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        SCRATCH,
        "--setenv",
        "TMPDIR",
        SCRATCH,
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--",
        python,
        *settings.python_flags,
        "-c",
        RUNNER,
        " ".join(f"{name}:{soft}:{hard}" for name, (soft, hard) in rlimits(settings).items()),
    ]
    return argv


def host_credentials(settings: SandboxSettings) -> dict[str, Any]:
    """Drop to the sandbox uid on the host when we are root; otherwise we already are unprivileged."""
    if os.geteuid() != 0:
        return {}
    return {"user": settings.sandbox_uid, "group": settings.sandbox_gid, "extra_groups": []}


def enable_subreaper() -> bool:
    """Adopt orphaned sandbox inits so they are reaped here, not left as zombies for the host's pid 1.

    bwrap exits before its namespace init does; without this a container whose pid 1 does not reap
    (a plain Python service, for one) accumulates a zombie per call.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _probe(bwrap: str, creds: dict[str, Any], attempts: int = 3) -> None:
    """Run `bwrap --version` as the sandbox user. A probe killed by a signal is retried: CI saw
    one SIGABRT out of many runs, and a flaky probe must not stop the service from starting."""
    for attempt in range(1, attempts + 1):
        try:
            subprocess.run([bwrap, "--version"], capture_output=True, check=True, timeout=10, **creds)
            return
        except subprocess.CalledProcessError as e:
            if e.returncode >= 0 or attempt == attempts:
                raise
            log.warning("sandbox_bwrap_probe_retry", signal=-e.returncode, attempt=attempt)


def reachable_bwrap(settings: SandboxSettings) -> str:
    """Return a bwrap the sandbox uid can execute, copying it to runtime_dir if the original is hidden.

    A checkout under /root is unreadable for uid 65534; the copy is root-owned and world-executable.
    """
    bwrap = settings.resolved_bwrap()
    creds = host_credentials(settings)
    try:
        _probe(bwrap, creds)
        return bwrap
    except PermissionError:
        if not creds:
            raise
    runtime = Path(settings.runtime_dir)
    runtime.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = runtime / "bwrap"
    shutil.copy2(bwrap, target)
    target.chmod(0o755)
    log.info("sandbox_bwrap_copied", source=bwrap, target=str(target))
    return str(target)


class SandboxProcess:
    """One started sandbox, good for exactly one request.

    bwrap's outer process exits as soon as the command does, before the namespace's init has torn
    the namespace down; so we also hold a pidfd on that init (its pid comes from `--info-fd`) and a
    call is over only when the init is gone, which the kernel guarantees implies every process of
    the namespace is gone.
    """

    def __init__(self, popen: subprocess.Popen[bytes], usage_fd: int, info_fd: int) -> None:
        self._popen = popen
        self._usage_fd = usage_fd
        self._info_fd = info_fd
        self.pid = popen.pid
        self._pidfd = os.pidfd_open(popen.pid)
        self._init_pidfd: int | None = None
        self._exit_future: asyncio.Future[None] | None = None
        self._gone: asyncio.Future[None] | None = None
        self._init_task: asyncio.Future[None] | None = None
        self.spawned_at = time.monotonic()
        self._reaped = False
        self.exit_code: int | None = None
        self.cpu_s = 0.0
        self.peak_rss_bytes = 0

    @classmethod
    def spawn(cls, argv: list[str], credentials: dict[str, Any]) -> SandboxProcess:
        """Start a sandbox whose runner blocks until `run` sends it a request."""
        usage_r, usage_w = os.pipe()
        info_r, info_w = os.pipe()
        try:
            popen = subprocess.Popen(
                [argv[0], "--info-fd", str(info_w), *argv[1:], str(usage_w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                cwd="/",
                close_fds=True,
                pass_fds=(usage_w, info_w),
                start_new_session=True,
                **credentials,
            )
        except BaseException:
            os.close(usage_r)
            os.close(info_r)
            raise
        finally:
            os.close(usage_w)
            os.close(info_w)
        os.set_blocking(usage_r, False)
        os.set_blocking(info_r, False)
        return cls(popen, usage_r, info_r)

    def alive(self) -> bool:
        return not self._reaped and self._try_reap() is None

    def _try_reap(self) -> int | None:
        if self._reaped:
            return self.exit_code
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return None
        self._reaped = True
        self.exit_code = os.waitstatus_to_exitcode(status)
        self._popen.returncode = self.exit_code
        self._read_usage()
        if self._exit_future is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            if not self._exit_future.done():
                self._exit_future.set_result(None)
        os.close(self._pidfd)
        return self.exit_code

    def _read_usage(self) -> None:
        """Usage the runner reported at exit: CPU since the request arrived, and peak RSS."""
        try:
            cpu, rss = os.read(self._usage_fd, 4096).split()
            self.cpu_s, self.peak_rss_bytes = max(self.cpu_s, float(cpu)), max(self.peak_rss_bytes, int(rss))
        except (OSError, ValueError, TypeError):
            pass
        finally:
            os.close(self._usage_fd)

    def _sample_usage(self) -> None:
        """Before a kill, when the runner cannot report: CPU and peak RSS summed over the live tree."""
        cpu_ticks, peak = 0, 0
        for pid in descendants(self.pid)[1:]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_ticks += int(stat[11]) + int(stat[12])
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except (OSError, ValueError, IndexError):
                continue
        self.cpu_s = max(self.cpu_s, cpu_ticks / CLOCK_TICKS)
        self.peak_rss_bytes = max(self.peak_rss_bytes, peak)

    async def _watch_init(self) -> None:
        """Learn the namespace init's pid from bwrap's info fd and pin it with a pidfd (once)."""
        if self._init_task is None:
            self._init_task = asyncio.ensure_future(self._read_init())
        await asyncio.shield(self._init_task)

    async def _read_init(self) -> None:
        if self._info_fd < 0:
            return
        loop = asyncio.get_running_loop()
        data = b""
        deadline = loop.time() + 5.0
        try:
            while loop.time() < deadline:
                try:
                    chunk = os.read(self._info_fd, 4096)
                except BlockingIOError:
                    readable: asyncio.Future[None] = loop.create_future()
                    loop.add_reader(self._info_fd, resolve, readable)
                    try:
                        await asyncio.wait_for(readable, deadline - loop.time())
                    except TimeoutError:
                        break
                    finally:
                        loop.remove_reader(self._info_fd)
                    continue
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._info_fd)
            self._info_fd = -1
        try:
            self._init_pidfd = os.pidfd_open(int(json.loads(data)["child-pid"]))
        except (ValueError, KeyError, TypeError, OSError):
            log.warning("sandbox_init_unknown", pid=self.pid, info=data[:200].decode(errors="replace"))

    def kill(self) -> None:
        """SIGKILL the namespace's init, which takes every process of the call with it."""
        if self._init_pidfd is not None:
            if not self._reaped:
                self._sample_usage()
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            return
        if self._reaped:
            return
        self._sample_usage()
        for child in children(self.pid):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(child), signal.SIGKILL)
        self._kill_outer()

    def _kill_outer(self) -> None:
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def _exited(self) -> int:
        """Wait for bwrap to exit; any number of waiters share one reader on the pidfd."""
        code = self._try_reap()
        if code is not None:
            return code
        if self._exit_future is None:
            loop = asyncio.get_running_loop()
            self._exit_future = loop.create_future()
            loop.add_reader(self._pidfd, self._on_exit)
        await asyncio.shield(self._exit_future)
        assert self.exit_code is not None
        return self.exit_code

    def _on_exit(self) -> None:
        self._try_reap()

    async def _namespace_gone(self) -> None:
        """Kill the init (a no-op once it is exiting) and wait until the kernel has emptied the namespace."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._empty_namespace())
        await asyncio.shield(self._gone)

    async def _empty_namespace(self) -> None:
        await self._watch_init()
        if self._init_pidfd is None:
            return
        pidfd, self._init_pidfd = self._init_pidfd, None
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, resolve, gone)
        try:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            await asyncio.wait_for(gone, 10.0)
        except TimeoutError:
            log.error("sandbox_namespace_not_gone", pid=self.pid)
        finally:
            loop.remove_reader(pidfd)
            # With bwrap gone the init was re-parented to us (see enable_subreaper): reap the zombie.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            os.close(pidfd)

    async def _send(self, payload: bytes) -> None:
        assert self._popen.stdin is not None
        fd = self._popen.stdin.fileno()
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        view = memoryview(payload)
        try:
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    writable: asyncio.Future[None] = loop.create_future()
                    loop.add_writer(fd, resolve, writable)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(fd)
        except BrokenPipeError:
            pass
        finally:
            self._popen.stdin.close()

    async def run(
        self, request: dict[str, Any], *, timeout_s: float, cpu_s: int, output_limit: int
    ) -> ProcessResult:
        """Send the request, capture output up to the cap, and kill the tree on timeout or overflow."""
        assert self._popen.stdout is not None and self._popen.stderr is not None
        cpu_limit = max(1, min(cpu_s, math.ceil(timeout_s) + 1))
        if request["kind"] == "python":
            message = f"python {cpu_limit}\n".encode() + request["code"].encode()
        else:
            message = f"exec {cpu_limit}\n".encode() + json.dumps(request).encode()
        start = time.perf_counter()
        capture = OutputCapture(
            {"stdout": self._popen.stdout.fileno(), "stderr": self._popen.stderr.fileno()},
            output_limit,
            self.kill,
        )
        timed_out = False
        wall = 0.0
        try:
            await self._watch_init()
            await self._send(message)
            try:
                await asyncio.wait_for(self._exited(), max(timeout_s - (time.perf_counter() - start), 0.001))
            except TimeoutError:
                timed_out = True
                self.kill()
            wall = time.perf_counter() - start
            await self.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(capture.done), 2.0)
            except TimeoutError:
                log.warning("sandbox_output_not_closed", pid=self.pid)
        finally:
            capture.stop()
            self._popen.stdout.close()
            self._popen.stderr.close()
            if not self._reaped or self._init_pidfd is not None:
                await self.terminate()
        return ProcessResult(
            exit_code=self.exit_code if self.exit_code is not None else -signal.SIGKILL,
            stdout=bytes(capture.buffers["stdout"]),
            stderr=bytes(capture.buffers["stderr"]),
            timed_out=timed_out,
            output_exceeded=capture.exceeded,
            wall_s=wall,
            cpu_s=self.cpu_s,
            peak_rss_bytes=self.peak_rss_bytes,
        )

    async def terminate(self) -> None:
        """End the sandbox for good: bwrap reaped, the namespace emptied, its init reaped, pipes closed."""
        if not self._reaped:
            self.kill()
        try:
            await asyncio.wait_for(self._exited(), 2.0)
        except TimeoutError:
            self._kill_outer()
            await asyncio.wait_for(self._exited(), 5.0)
        await self._namespace_gone()
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            self._popen.stdin.close()

    def close_pipes(self) -> None:
        for stream in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self._info_fd >= 0:
            os.close(self._info_fd)
            self._info_fd = -1
