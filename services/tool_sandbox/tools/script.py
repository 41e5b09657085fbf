"""Tools of your own (`task.tool_plugins`, or installed packages' `libra.tools` entry points): a Python
file with `NAME`, `DESCRIPTION`, `SCHEMA` (the JSON schema of its arguments) and `def run(**args)`,
executed in the same sandbox as the python tool.

The file's constants are read with `ast.literal_eval`, never by importing it: the user's code runs
only inside the sandbox, once per call, with the validated arguments. `run` returns a string
(the observation) or anything JSON-serialisable; an exception makes the call's status `error`
with its traceback on stderr."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult, process_result

ENTRY_POINT_GROUP = "libra.tools"
"""Installed packages declare tools here: `[project.entry-points."libra.tools"] NAME = "pkg.module"`,
the module being a tool plugin file (standard library only: it runs alone in the sandbox)."""
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_STUB = """

import json as _libra_json
_libra_result = run(**_libra_json.loads({args!r}))
print(_libra_result if isinstance(_libra_result, str) else _libra_json.dumps(_libra_result))
"""


class ToolPluginError(ValueError):
    """A tool plugin file that cannot be used; the message names the file and what is wrong."""


def _constants(tree: ast.Module, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("NAME", "DESCRIPTION", "SCHEMA"):
                try:
                    out[name] = ast.literal_eval(node.value)
                except ValueError as e:
                    raise ToolPluginError(f"{path}: {name} must be a literal ({e})") from e
    return out


def read_plugin(path: str | Path) -> tuple[str, str, dict[str, Any], str]:
    """(name, description, schema, source) of a tool plugin file, checked without running it."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ToolPluginError(f"{path}: cannot read the tool plugin ({e.strerror or e})") from e
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise ToolPluginError(f"{path}:{e.lineno}: {e.msg}") from e
    consts = _constants(tree, path)
    missing = [k for k in ("NAME", "DESCRIPTION", "SCHEMA") if k not in consts]
    if missing:
        raise ToolPluginError(
            f"{path}: a tool plugin defines NAME, DESCRIPTION and SCHEMA; missing {missing}"
        )
    name, description, schema = consts["NAME"], consts["DESCRIPTION"], consts["SCHEMA"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolPluginError(f"{path}: NAME must match {_NAME.pattern}, got {name!r}")
    if not isinstance(description, str):
        raise ToolPluginError(f"{path}: DESCRIPTION must be a string")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ToolPluginError(
            f"{path}: SCHEMA must be a JSON schema of an object ({{'type': 'object', ...}})"
        )
    if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
        raise ToolPluginError(f"{path}: a tool plugin defines `def run(**args)`")
    return name, description, schema, source


class ScriptTool(Tool):
    """A tool plugin file, run in a fresh sandbox per call."""

    name = "script"
    description = ""
    sandboxed = True

    def __init__(self, settings: SandboxSettings, path: str | Path) -> None:
        super().__init__(settings)
        self.tool_name, self.tool_description, self._schema, self.source = read_plugin(path)
        self.path = Path(path)

    def schema(self) -> dict[str, Any]:
        return dict(self._schema)

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        code = self.source + _STUB.format(args=json.dumps(args))
        result = await sandbox({"kind": "python", "code": code}, timeout_s)
        return process_result(result, self.settings, timeout_s)


def plugin_tools(settings: SandboxSettings, paths: list[str]) -> dict[str, Tool]:
    """The plugin files' tools by name; two with one name is an error."""
    tools: dict[str, Tool] = {}
    for p in paths:
        tool = ScriptTool(settings, p)
        if tool.tool_name in tools:
            raise ToolPluginError(f"{p}: a second tool named {tool.tool_name!r}")
        tools[tool.tool_name] = tool
    return tools


def installed_plugins(path: list[str] | None = None) -> list[str]:
    """The tool plugin files that installed distributions (on `path`, default sys.path) declare in
    the `libra.tools` entry-point group, found without importing them; the entry point's name is
    the tool's NAME."""
    found: dict[str, str] = {}
    dists = (
        importlib.metadata.distributions(path=path)
        if path is not None
        else importlib.metadata.distributions()
    )
    for dist in dists:
        for ep in dist.entry_points.select(group=ENTRY_POINT_GROUP):
            where = f"entry point {ep.name} = {ep.value!r} of {dist.metadata['Name']}"
            file = _module_file(dist, ep.module)
            if file is None:
                raise ToolPluginError(f"{where}: module {ep.module} not found")
            name = read_plugin(file)[0]
            if name != ep.name:
                raise ToolPluginError(f"{where}: the file's NAME is {name!r}; name the entry point so")
            if found.setdefault(name, file) != file:
                raise ToolPluginError(f"{where}: a second installed tool named {name!r} ({found[name]})")
    return sorted(found.values())


def _module_file(dist: importlib.metadata.Distribution, module: str) -> str | None:
    rel = module.replace(".", "/")
    for f in dist.files or []:
        if str(f) in (f"{rel}.py", f"{rel}/__init__.py"):
            return str(Path(str(dist.locate_file(f))).resolve())
    try:  # an editable install: its files are not in the record
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return str(Path(spec.origin).resolve()) if spec is not None and spec.origin else None


def tool_plugin_files(configured: list[str]) -> list[str]:
    """`task.tool_plugins` and the installed tools, each file once."""
    out: dict[str, str] = {}
    for p in [*configured, *installed_plugins()]:
        out.setdefault(str(Path(p).resolve()), p)
    return list(out.values())
