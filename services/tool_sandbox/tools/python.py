"""Run a Python snippet in a sandbox and return its stdout, stderr and exit code."""

from __future__ import annotations

from typing import Any

from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult, process_result


class PythonTool(Tool):
    name = "python"
    description = (
        "Run a Python 3 snippet (stdlib only) in an isolated sandbox; returns stdout/stderr/exit code."
    )
    sandboxed = True

    def schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 1, "maxLength": self.settings.max_code_bytes},
            },
            "required": ["code"],
            "additionalProperties": False,
        }

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        result = await sandbox({"kind": "python", "code": args["code"]}, timeout_s)
        return process_result(result, self.settings, timeout_s)
