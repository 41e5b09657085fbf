"""`python -m services.trainer --help` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import runpy, sys
sys.argv = ["services.trainer", "--help"]
try:
    runpy.run_module("services.trainer", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
assert "torch" not in sys.modules, "torch imported by --help"
"""


def test_help_does_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "LIBRA_TRAINER_FETCH_BATCH" in out.stdout
