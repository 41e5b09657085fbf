"""Tool plugin files are read without running them, and refused with the file and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tool_sandbox.tools.script import ToolPluginError, installed_plugins, read_plugin
from tests.installed_tool import install_tool_package
from tools.stack import ROOT


def test_the_example_plugin_reads_without_running() -> None:
    name, description, schema, source = read_plugin(ROOT / "examples" / "custom" / "unit_tool.py")
    assert name == "convert" and "units of time" in description
    assert schema["required"] == ["value", "from", "to"] and "def run(" in source


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("NAME = 'x'\nDESCRIPTION = 'd'\ndef run(): pass\n", r"missing \['SCHEMA'\]"),
        (
            "NAME = 'Bad Name'\nDESCRIPTION = 'd'\nSCHEMA = {'type': 'object'}\ndef run(): pass\n",
            "NAME must match",
        ),
        ("NAME = 'x'\nDESCRIPTION = 'd'\nSCHEMA = {'type': 'string'}\ndef run(): pass\n", "SCHEMA must be"),
        ("NAME = 'x'\nDESCRIPTION = 'd'\nSCHEMA = {'type': 'object'}\n", "def run"),
        (
            "NAME = 'x'\nDESCRIPTION = 'd'\nSCHEMA = dict(type='object')\ndef run(): pass\n",
            "SCHEMA must be a literal",
        ),
        ("def run(:\n", r"t.py:1: "),
        ("import os\nos.system('touch /tmp/pwned')\nNAME = 'x'\n", "missing"),  # read, never run
    ],
)
def test_a_bad_plugin_is_refused_with_its_reason(tmp_path: Path, source: str, message: str) -> None:
    path = tmp_path / "t.py"
    path.write_text(source)
    with pytest.raises(ToolPluginError, match=message):
        read_plugin(path)


def test_a_missing_plugin_file(tmp_path: Path) -> None:
    with pytest.raises(ToolPluginError, match="cannot read the tool plugin"):
        read_plugin(tmp_path / "none.py")


def test_installed_packages_declare_tools_by_entry_point(tmp_path: Path) -> None:
    file = install_tool_package(tmp_path, "convert")
    assert installed_plugins([str(tmp_path)]) == [str(file.resolve())]  # found, never imported


@pytest.mark.parametrize(
    ("entry", "module", "message"),
    [
        ("units", "mytools.units", "the file's NAME is 'convert'"),
        ("convert", "mytools.missing", "module mytools.missing not found"),
    ],
)
def test_a_broken_entry_point_is_refused_with_its_package_named(
    tmp_path: Path, entry: str, module: str, message: str
) -> None:
    install_tool_package(tmp_path, entry, module)
    with pytest.raises(ToolPluginError, match=f"entry point {entry} = '{module}' of mytools: {message}"):
        installed_plugins([str(tmp_path)])
