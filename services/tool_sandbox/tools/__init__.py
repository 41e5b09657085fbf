"""Tool registry: adding a tool is adding a module and a line here."""

from __future__ import annotations

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult
from services.tool_sandbox.tools.calculator import CalculatorTool
from services.tool_sandbox.tools.python import PythonTool
from services.tool_sandbox.tools.search import SearchTool
from services.tool_sandbox.tools.shell import ShellTool
from services.tool_sandbox.tools.synthetic import SyntheticTool

TOOLS: dict[str, type[Tool]] = {
    cls.name: cls for cls in (PythonTool, CalculatorTool, SearchTool, ShellTool, SyntheticTool)
}


def build_tools(settings: SandboxSettings) -> dict[str, Tool]:
    return {name: cls(settings) for name, cls in TOOLS.items()}


__all__ = ["TOOLS", "SandboxRun", "Tool", "ToolResult", "build_tools"]
