"""The tool interface: a name, a JSON schema for the arguments, and an async call."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.isolation import ProcessResult
from services.tool_sandbox.outcome import Status, classify_exit

SandboxRun = Callable[[dict[str, Any], float], Awaitable[ProcessResult]]
"""Runs one request in a fresh sandbox with the given wall limit (the executor provides it)."""


@dataclass(slots=True)
class ToolResult:
    """What a tool reports; the executor adds size class and timings to make a ToolOutcome."""

    status: Status
    payload: str = ""
    error: str = ""
    exit_code: int = 0
    truncated: bool = False
    process: ProcessResult | None = None


class Tool(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    sandboxed: ClassVar[bool] = False
    """Whether calls need a sandbox (and so a concurrency slot); in-process tools are bounded by design."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings

    @abstractmethod
    def schema(self) -> dict[str, Any]:
        """JSON schema of the arguments object."""

    async def start(self) -> None:
        """Load whatever the tool needs once (an index, a corpus)."""
        return None

    @abstractmethod
    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        """Run one validated call; raise only for bugs (the executor turns those into `error`)."""


def process_result(result: ProcessResult, settings: SandboxSettings, timeout_s: float) -> ToolResult:
    """Payload of process-backed tools: compact JSON `{"stdout", "stderr", "exit_code"}`."""
    status, error = classify_exit(
        result.exit_code,
        timed_out=result.timed_out,
        output_exceeded=result.output_exceeded,
        timeout_s=timeout_s,
        output_limit=settings.max_output_bytes,
    )
    payload = json.dumps(
        {
            "stdout": result.stdout.decode("utf-8", "replace"),
            "stderr": result.stderr.decode("utf-8", "replace"),
            "exit_code": result.exit_code,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return ToolResult(
        status=status,
        payload=payload,
        error=error,
        exit_code=result.exit_code,
        truncated=result.output_exceeded,
        process=result,
    )
