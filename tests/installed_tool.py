"""A package with a `libra.tools` entry point, installed into a directory by writing its files and
dist-info (what pip would leave), for the tests of tools from installed packages."""

from __future__ import annotations

from pathlib import Path

from tools.stack import ROOT


def install_tool_package(site: Path, entry: str, module: str = "mytools.units") -> Path:
    """A distribution installed into `site` (a dist-info with a RECORD), declaring `entry`."""
    pkg = site / "mytools"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (pkg / "units.py").write_text((ROOT / "examples" / "custom" / "unit_tool.py").read_text())
    info = site / "mytools-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mytools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[libra.tools]\n{entry} = {module}\n")
    (info / "RECORD").write_text(
        "mytools/__init__.py,,\nmytools/units.py,,\nmytools-1.0.dist-info/METADATA,,\n"
    )
    return pkg / "units.py"
