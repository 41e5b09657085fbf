"""The tool-return outcome: the causal signal C-MLFQ schedules by, and how a process exit maps onto it."""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"
    REJECTED = "rejected"


class SizeClass(StrEnum):
    SMALL = "small"
    MEDIUM = "medium"
    LARGE = "large"


# Exit codes the in-sandbox runner uses when a snippet dies of an uncaught resource-limit error.
EXIT_MEMORY_LIMIT = 251
EXIT_FILE_LIMIT = 252


@dataclass(slots=True)
class ToolOutcome:
    """One tool return, with the features the scheduler reads (status, size class, timings)."""

    tool: str
    status: str
    payload: str = ""
    payload_bytes: int = 0
    size_class: str = SizeClass.SMALL.value
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_bytes: int = 0
    truncated: bool = False
    exit_code: int = 0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_class(payload_bytes: int, medium_bytes: int, large_bytes: int) -> SizeClass:
    if payload_bytes >= large_bytes:
        return SizeClass.LARGE
    if payload_bytes >= medium_bytes:
        return SizeClass.MEDIUM
    return SizeClass.SMALL


def classify_exit(
    exit_code: int, *, timed_out: bool, output_exceeded: bool, timeout_s: float, output_limit: int
) -> tuple[Status, str]:
    """Map how a sandboxed process ended to (status, reason).

    bwrap reports a command killed by signal N as exit code 128+N; a negative code means the
    bwrap process itself was signalled. Host-side decisions (wall timeout, output cap) win.
    """
    if timed_out:
        return Status.TIMEOUT, f"wall time limit of {timeout_s:g}s exceeded"
    if output_exceeded:
        return Status.KILLED, f"output limit of {output_limit} bytes exceeded"
    if exit_code == 0:
        return Status.OK, ""
    if exit_code == EXIT_MEMORY_LIMIT:
        return Status.KILLED, "memory limit exceeded (MemoryError)"
    if exit_code == EXIT_FILE_LIMIT:
        return Status.KILLED, "file size or scratch space limit exceeded"
    signum = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code <= 128 + 64 else 0
    if signum == signal.SIGXCPU:
        return Status.TIMEOUT, "cpu time limit exceeded (SIGXCPU)"
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return Status.KILLED, f"terminated by {name}"
    return Status.ERROR, f"exited with code {exit_code}"
