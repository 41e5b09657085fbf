"""`libra sandbox ...`: run one tool call through the service's own executor and print the outcome."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="libra sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("exec", help="run one tool call in a sandbox and print the tool return as JSON")
    run.add_argument("--tool", required=True, help="python | calculator | search | shell, or a plugin's NAME")
    run.add_argument("--code-file", type=Path, help="file whose text becomes the `code` argument (python)")
    run.add_argument("--args", default=None, help='JSON object of tool arguments, e.g. \'{"query": "bm25"}\'')
    run.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds")
    run.add_argument("--warm", action="store_true", help="keep the configured warm pool (off for one-offs)")
    schemas = sub.add_parser("schemas", help="print the JSON schema of every tool's arguments")
    for p in (run, schemas):
        p.add_argument(
            "--plugin",
            action="append",
            default=[],
            metavar="FILE",
            help="a tool plugin file, as task.tool_plugins names it (repeatable; installed plugins are always there)",
        )
    return parser


def _arguments(ns: argparse.Namespace) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if ns.args is not None:
        parsed = json.loads(ns.args)
        if not isinstance(parsed, dict):
            raise ValueError("--args must be a JSON object")
        args.update(parsed)
    if ns.code_file is not None:
        args["code"] = ns.code_file.read_text()
    return args


async def _exec(ns: argparse.Namespace, args: dict[str, Any]) -> dict[str, Any]:
    from services.tool_sandbox.config import SandboxSettings
    from services.tool_sandbox.executor import SandboxExecutor
    from services.tool_sandbox.tools.script import tool_plugin_files

    settings = SandboxSettings()
    if not ns.warm:
        settings = settings.model_copy(update={"pool_size": 0})
    executor = SandboxExecutor(settings, tool_plugin_files(ns.plugin))
    await executor.start()
    try:
        outcome = await executor.execute(ns.tool, args, timeout_s=ns.timeout)
    finally:
        await executor.close()
    return outcome.to_dict()


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the call's status is `ok`, 1 for any other status, 2 for bad command-line input."""
    ns = _parser().parse_args(argv)
    from services.common.logging import configure_logging

    configure_logging("tool-sandbox-cli", fmt="console", level="warning")
    from services.tool_sandbox.tools.script import ToolPluginError

    if ns.command == "schemas":
        from services.tool_sandbox.config import SandboxSettings
        from services.tool_sandbox.tools import build_tools
        from services.tool_sandbox.tools.script import plugin_tools, tool_plugin_files

        settings = SandboxSettings()
        try:
            tools = build_tools(settings) | plugin_tools(settings, tool_plugin_files(ns.plugin))
        except ToolPluginError as exc:
            print(f"libra sandbox schemas: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({name: tool.schema() for name, tool in tools.items()}, indent=2))
        return 0
    try:
        args = _arguments(ns)
    except (OSError, ValueError) as exc:
        print(f"libra sandbox exec: {exc}", file=sys.stderr)
        return 2
    try:
        outcome = asyncio.run(_exec(ns, args))
    except ToolPluginError as exc:
        print(f"libra sandbox exec: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(outcome, ensure_ascii=False))
    return 0 if outcome["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
