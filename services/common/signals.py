"""A tool return as C-MLFQ sees it: tool, payload size class, status (the causal signals)."""

from __future__ import annotations

from dataclasses import dataclass

SIZE_CLASSES = ("small", "medium", "large")
STATUSES = ("success", "failure", "timeout")

_SANDBOX_STATUS = {
    "ok": "success",
    "success": "success",
    "error": "failure",
    "rejected": "failure",
    "failure": "failure",
    "timeout": "timeout",
    "killed": "timeout",
}


def map_sandbox_status(status: str) -> str:
    """Map a tool-sandbox status to the C-MLFQ status alphabet.

    ok -> success; error, rejected -> failure; timeout, killed -> timeout. A killed tool ran out
    of its limits, which predicts the same extra work as a timeout. Unknown statuses are failures.
    """
    return _SANDBOX_STATUS.get(status, "failure")


def size_class(payload_tokens: int, thresholds: tuple[int, int] = (512, 4096)) -> str:
    """Bucket a tool payload size (tokens or bytes, as long as thresholds use the same unit)."""
    if payload_tokens < thresholds[0]:
        return "small"
    if payload_tokens < thresholds[1]:
        return "medium"
    return "large"


@dataclass(frozen=True, slots=True)
class ToolSignal:
    """One tool return as C-MLFQ sees it."""

    tool: str
    size: str = "small"
    status: str = "success"

    @property
    def key(self) -> str:
        return f"{self.tool}|{self.size}|{self.status}"

    @classmethod
    def from_sandbox(cls, tool: str, payload_tokens: int, sandbox_status: str) -> ToolSignal:
        return cls(tool, size_class(payload_tokens), map_sandbox_status(sandbox_status))
