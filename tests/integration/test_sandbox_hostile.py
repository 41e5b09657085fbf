"""Hostile snippets against real bubblewrap sandboxes: each is contained, classified, and leaves no trace."""

from __future__ import annotations

import ast
import json
import os
import socket
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.executor import SandboxExecutor, ToolOutcome

pytestmark = pytest.mark.integration

# A uid nothing else on the host uses, so every process or file it owns is the sandbox's.
SANDBOX_UID = 61234
REPO = Path(__file__).resolve().parents[2]
WATCHED = [Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), REPO]
SKIP_DIRS = {".venv", ".git", "node_modules"}


def sandbox_processes() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == SANDBOX_UID:
                    pids.append(int(entry))
            except FileNotFoundError:
                continue
    return pids


def sandbox_files() -> list[str]:
    found = []
    for root in WATCHED:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    if os.lstat(path).st_uid == SANDBOX_UID:
                        found.append(path)
                except FileNotFoundError:
                    continue
    return found


@pytest.fixture(scope="module")
async def executor() -> AsyncIterator[SandboxExecutor]:
    settings = SandboxSettings(
        sandbox_uid=SANDBOX_UID,
        sandbox_gid=SANDBOX_UID,
        pool_size=0,
        default_timeout_s=5.0,
        memory_bytes=256 << 20,
        max_processes=16,
        max_file_bytes=8 << 20,
        scratch_bytes=16 << 20,
        max_output_bytes=256 << 10,
    )
    ex = SandboxExecutor(settings)
    await ex.start()
    yield ex
    await ex.close()
    assert sandbox_processes() == []


async def run_contained(ex: SandboxExecutor, code: str, timeout_s: float | None = None) -> ToolOutcome:
    """Run hostile code, then check the host: no sandbox process or file left, executor still serving."""
    out = await ex.execute("python", {"code": textwrap.dedent(code)}, timeout_s=timeout_s)
    assert sandbox_processes() == [], "a sandboxed process outlived its call"
    assert sandbox_files() == [], "the sandbox left a file on the host"
    probe = await ex.execute("python", {"code": "print(6 * 7)"})
    assert probe.status == "ok" and json.loads(probe.payload)["stdout"] == "42\n"
    return out


def streams(out: ToolOutcome) -> tuple[str, str]:
    payload = json.loads(out.payload)
    return payload["stdout"], payload["stderr"]


async def test_network_egress_reaches_nothing(executor: SandboxExecutor) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    host_ip = socket.gethostbyname(socket.gethostname())
    try:
        out = await run_contained(
            executor,
            f"""
            import socket
            for host in ("127.0.0.1", "{host_ip}", "8.8.8.8"):
                try:
                    socket.create_connection((host, {port}), timeout=1).close()
                    print("CONNECTED", host)
                except OSError as exc:
                    print("blocked", host, exc.errno)
            socket.create_connection(("{host_ip}", {port}), timeout=1)
            """,
        )
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    stdout, stderr = streams(out)
    assert out.status == "error"
    assert "CONNECTED" not in stdout and stdout.count("blocked") == 3
    assert "OSError" in stderr or "Error" in stderr


async def test_writes_outside_scratch_fail(executor: SandboxExecutor) -> None:
    targets = [
        REPO / "sandbox-escape.txt",
        Path("/etc/sandbox-escape"),
        Path("/usr/sandbox-escape"),
        Path("/x"),
    ]
    out = await run_contained(
        executor,
        f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("pwned")
                print("WROTE", path)
            except OSError as exc:
                print("denied", path, type(exc).__name__)
        open("/scratch/ok.txt", "w").write("fine")
        open({str(targets[0])!r}, "w").write("pwned")
        """,
    )
    stdout, _ = streams(out)
    assert out.status == "error"
    assert "WROTE" not in stdout and stdout.count("denied") == len(targets)
    assert not any(t.exists() for t in targets)


async def test_host_files_are_invisible(executor: SandboxExecutor) -> None:
    secrets = ["/etc/shadow", "/etc/passwd", "/root/.bashrc", str(REPO / "pyproject.toml"), "/proc/1/environ"]
    out = await run_contained(
        executor,
        f"""
        import os
        for path in {secrets!r}:
            try:
                data = open(path, "rb").read()
                print("READ", path, len(data))
            except OSError as exc:
                print("hidden", path, type(exc).__name__)
        print("ENV", sorted(os.environ))
        open({str(REPO / "pyproject.toml")!r}).read()
        """,
    )
    stdout, stderr = streams(out)
    assert out.status == "error" and "FileNotFoundError" in stderr
    assert "[project]" not in stdout
    # /proc/1 is the sandbox's own init, whose environment is empty; everything else must not exist.
    assert all(line.startswith(("hidden", "ENV", "READ /proc/1/environ 0")) for line in stdout.splitlines())
    env = ast.literal_eval(stdout.split("ENV ", 1)[1].splitlines()[0])
    assert set(env) <= {"HOME", "LANG", "LC_CTYPE", "PATH", "PWD", "PYTHONDONTWRITEBYTECODE", "TMPDIR"}


async def test_fork_bomb_is_bounded(executor: SandboxExecutor) -> None:
    out = await run_contained(
        executor,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=2,
    )
    assert out.status == "timeout"
    assert "wall time" in out.error


async def test_memory_bomb_is_killed(executor: SandboxExecutor) -> None:
    out = await run_contained(executor, "hog = []\nwhile True:\n    hog.append(bytearray(16 << 20))\n")
    assert out.status == "killed" and "memory" in out.error
    assert out.peak_rss_bytes <= 300 << 20


async def test_disk_fill_is_capped(executor: SandboxExecutor) -> None:
    one_file = await run_contained(
        executor,
        "with open('/scratch/big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n",
    )
    assert one_file.status == "killed" and "file size" in one_file.error
    many_files = await run_contained(
        executor,
        "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20))\n    i += 1\n",
    )
    assert many_files.status == "killed"
    assert "No space left" in streams(many_files)[1]


async def test_infinite_loop_times_out(executor: SandboxExecutor) -> None:
    out = await run_contained(executor, "while True:\n    pass\n", timeout_s=1.5)
    assert out.status == "timeout"
    assert out.cpu_s > 0.5


async def test_huge_output_is_truncated_and_killed(executor: SandboxExecutor) -> None:
    out = await run_contained(
        executor, "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    )
    assert out.status == "killed" and out.truncated
    assert "output limit" in out.error
    stdout, _ = streams(out)
    assert len(stdout) <= executor.settings.max_output_bytes
    assert out.payload_bytes < 2 * executor.settings.max_output_bytes
    assert out.size_class == "large"


async def test_detached_children_die_with_the_call(executor: SandboxExecutor) -> None:
    out = await run_contained(
        executor,
        """
        import os, subprocess
        subprocess.Popen(["/bin/sleep", "300"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(300)
            os._exit(0)
        print("parent done")
        """,
    )
    assert out.status == "ok"
    assert streams(out)[0] == "parent done\n"


async def test_signalling_the_parent_does_not_escape(executor: SandboxExecutor) -> None:
    out = await run_contained(
        executor,
        f"""
        import os, signal
        for target in (os.getppid(), 1, {os.getpid()}, -1):
            try:
                os.kill(target, signal.SIGKILL)
                print("sent", target)
            except OSError as exc:
                print("refused", target, type(exc).__name__)
        print("still here")
        """,
    )
    # The host pid does not exist in the sandbox's pid namespace, and its init ignores SIGKILL from inside.
    assert out.status == "ok"
    assert "still here" in streams(out)[0]
    assert os.getpid() > 0  # the test process (and its executor) survived


async def test_killing_its_own_runner_is_reported(executor: SandboxExecutor) -> None:
    out = await run_contained(executor, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert out.status == "killed" and out.error == "terminated by SIGKILL"


async def test_executor_serves_concurrently_after_abuse(executor: SandboxExecutor) -> None:
    import asyncio

    outs = await asyncio.gather(
        *(executor.execute("python", {"code": f"print({i} * 2)"}) for i in range(6)),
        executor.execute("python", {"code": "while True: pass"}, timeout_s=1),
    )
    assert [json.loads(o.payload)["stdout"] for o in outs[:6]] == [f"{i * 2}\n" for i in range(6)]
    assert outs[6].status == "timeout"
    assert sandbox_processes() == []
