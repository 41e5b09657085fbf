"""Where one host's CPU went over a window, by the role of each process: the real engines'
workers, their vLLM engine-core processes, the rollout-engine services that front them, the other
services, the bus and store, and the rest.

`libra bench live --backend vllm` meters each job (`Meter`): on a CPU host the simulator prices an
engine's iterations from a calibration of the engine alone (`libra calibrate`), and what else
takes the cores during a job is what that price misses. From `/proc` (Linux); elsewhere empty.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ROLES = (
    ("VLLM::Worker", "vllm worker"),
    ("bin/libra", "libra command"),
    ("VLLM::EngineCore", "vllm engine core"),
    ("services.rollout_engine", "rollout-engine service"),
    ("services.", "other services"),
    ("nats-server", "nats + redis"),
    ("redis-server", "nats + redis"),
)
"""A process's role: the first of these its command line contains (vLLM names its processes)."""

PROC = Path("/proc")


def role(cmdline: str) -> str:
    if not cmdline.strip():
        return "kernel"
    for needle, name in ROLES:
        if needle in cmdline:
            return name
    return "other"


def _ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


Key = tuple[int, int]
"""A process: its pid and its start time (a reused pid is another process)."""


def snapshot(proc: Path = PROC) -> dict[Key, tuple[str, float]]:
    """Every process now: (pid, start) -> (role, CPU seconds it has used, user and system)."""
    out: dict[Key, tuple[str, float]] = {}
    if not proc.is_dir():
        return out
    tick = _ticks()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        # the fields after the command name (which may hold spaces, in parentheses)
        fields = stat[stat.rfind(")") + 2 :].split()
        try:
            seconds = (int(fields[11]) + int(fields[12])) / tick
            start = int(fields[19])
        except (IndexError, ValueError):
            continue
        out[(int(entry.name), start)] = (role(cmdline), seconds)
    return out


def spent(
    before: dict[Key, tuple[str, float]], after: dict[Key, tuple[str, float]], wall_s: float
) -> dict[str, dict[str, float]]:
    """CPU seconds by role between two snapshots (a process by the role it has in `after`: vLLM
    names its processes once they start), and as cores (seconds over `wall_s`). A process started
    in between counts from zero; one that ended in between is not seen (`Meter` sees it up to its
    last sample)."""
    by: dict[str, float] = {}
    for key, (name, seconds) in after.items():
        prev = before.get(key)
        if prev is not None:
            name = _named(prev[0], name)
        used = seconds - (prev[1] if prev is not None else 0.0)
        if used > 0:
            by[name] = by.get(name, 0.0) + used
    wall = max(wall_s, 1e-9)
    return {
        name: {"cpu_s": round(s, 2), "cores": round(s / wall, 3)}
        for name, s in sorted(by.items(), key=lambda kv: -kv[1])
    }


def _named(earlier: str, later: str) -> str:
    """A process's role seen twice: the later, unless the process lost its command line (an
    exiting process shows none, as a kernel thread does)."""
    return earlier if later == "kernel" and earlier != "kernel" else later


def _merge(last: dict[Key, tuple[str, float]], snap: dict[Key, tuple[str, float]]) -> None:
    for key, (name, seconds) in snap.items():
        prev = last.get(key)
        last[key] = (_named(prev[0], name) if prev is not None else name, seconds)


class Meter:
    """CPU seconds by role over a `with` block, sampled every `interval_s` so that processes that
    end inside it (a job's engines stop with the job) count up to their last sample."""

    def __init__(self, interval_s: float = 2.0, proc: Path = PROC) -> None:
        self.interval_s = interval_s
        self.proc = proc
        self.first: dict[Key, tuple[str, float]] = {}
        self.last: dict[Key, tuple[str, float]] = {}
        self.usage: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> Meter:
        self._t0 = time.monotonic()
        self.first = snapshot(self.proc)
        self.last = dict(self.first)
        self._thread = threading.Thread(target=self._run, name="host-cpu-meter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            _merge(self.last, snapshot(self.proc))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _merge(self.last, snapshot(self.proc))
        self.usage = spent(self.first, self.last, time.monotonic() - self._t0)


def line(usage: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{name} {u['cores']:.2f}" for name, u in usage.items() if u["cores"] >= 0.005)
