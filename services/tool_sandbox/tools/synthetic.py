"""The synthetic workload's tool: waits a given time and returns a payload of a given size class
with a given outcome, so a workload drawn from a simulator YAML runs through the real sandbox
service (its queueing, limits, size classification and bus round trip) with the drawn latencies,
outcomes and payload sizes.

Nothing runs in a sandbox and nothing is computed: it is bounded by design (the call's timeout,
a payload of at most the large-class threshold plus one byte), so it runs in-process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.tool_sandbox.outcome import Status
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult

OUTCOMES = {"success": Status.OK, "failure": Status.ERROR, "timeout": Status.TIMEOUT}


class SyntheticTool(Tool):
    name = "synthetic"
    description = (
        "Synthetic workloads only: wait `seconds` (at most the call's timeout), then return a `size`"
        " payload with outcome `status`."
    )

    def schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "seconds": {"type": "number", "minimum": 0, "maximum": 3600},
                "size": {"enum": ["small", "medium", "large"]},
                "status": {"enum": list(OUTCOMES)},
            },
            "required": ["seconds", "size", "status"],
            "additionalProperties": False,
        }

    def payload_bytes(self, size: str) -> int:
        """A payload the executor classifies as `size` with this sandbox's thresholds."""
        medium, large = self.settings.size_class_medium_bytes, self.settings.size_class_large_bytes
        return {"small": max(1, medium // 2), "medium": (medium + large) // 2, "large": large + 1}[size]

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        status = OUTCOMES[args["status"]]
        # ends just inside the call's timeout, so that no deadline around it cuts it first
        limit = max(0.0, timeout_s * 0.98 - 0.01)
        wait = min(float(args["seconds"]), limit)
        await asyncio.sleep(wait)
        payload = "x" * self.payload_bytes(args["size"])  # what the simulator charges any outcome
        if status is Status.TIMEOUT or float(args["seconds"]) > limit:
            return ToolResult(
                status=Status.TIMEOUT, payload=payload, error=f"synthetic tool timed out after {wait:g}s"
            )
        if status is Status.ERROR:
            return ToolResult(status=Status.ERROR, payload=payload, error="synthetic failure", exit_code=1)
        return ToolResult(status=Status.OK, payload=payload)
