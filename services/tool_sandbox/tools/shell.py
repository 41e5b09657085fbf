"""A shell-style tool: a pipeline of allow-listed commands, no shell syntax beyond `|`.

Every word is quoted before it reaches `/bin/sh`, so `$`, globs, redirections and `;` are literal
text; only the pipe is interpreted. The pipeline still runs inside the sandbox.
"""

from __future__ import annotations

import shlex
import shutil
from typing import Any

from services.tool_sandbox.outcome import Status
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult, process_result

MAX_STAGES = 8


class CommandRejected(ValueError):
    pass


def parse_pipeline(command: str, allowed: set[str]) -> list[list[str]]:
    """Split `a x | b y` into stages; reject shell operators other than `|` and unknown commands."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise CommandRejected(f"cannot parse command: {exc}") from exc
    stages: list[list[str]] = [[]]
    for token in tokens:
        if token == "|":
            stages.append([])
        elif token and set(token) <= set("();<>|&"):
            raise CommandRejected(f"shell operator {token!r} is not allowed (only '|')")
        else:
            stages[-1].append(token)
    if any(not stage for stage in stages):
        raise CommandRejected("empty command in pipeline")
    if len(stages) > MAX_STAGES:
        raise CommandRejected(f"at most {MAX_STAGES} pipeline stages")
    for stage in stages:
        if stage[0] not in allowed:
            raise CommandRejected(
                f"command {stage[0]!r} is not allowed; allowed: {', '.join(sorted(allowed))}"
            )
    return stages


def to_script(stages: list[list[str]]) -> str:
    """Resolve each command to an absolute path and quote every word."""
    parts = []
    for stage in stages:
        path = shutil.which(stage[0], path="/usr/bin:/bin")
        if path is None:
            raise CommandRejected(f"command {stage[0]!r} is not installed")
        parts.append(" ".join(shlex.quote(word) for word in [path, *stage[1:]]))
    return " | ".join(parts)


class ShellTool(Tool):
    name = "shell"
    description = "Run a pipeline of safe text commands (e.g. `grep x | sort | uniq -c`) on the given stdin."
    sandboxed = True

    def schema(self) -> dict[str, Any]:
        limit = self.settings.max_code_bytes
        return {
            "type": "object",
            "properties": {
                "command": {"type": "string", "minLength": 1, "maxLength": 4096},
                "stdin": {"type": "string", "maxLength": limit},
            },
            "required": ["command"],
            "additionalProperties": False,
        }

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        try:
            script = to_script(parse_pipeline(args["command"], set(self.settings.shell_commands)))
        except CommandRejected as exc:
            return ToolResult(status=Status.REJECTED, error=str(exc))
        request = {"kind": "exec", "argv": ["/bin/sh", "-c", script], "stdin": args.get("stdin", "")}
        result = await sandbox(request, timeout_s)
        return process_result(result, self.settings, timeout_s)
