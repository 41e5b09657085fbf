"""One service as a real process for an integration test: `python -m services.<name>`."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def service_process(module: str, env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Starts `python -m <module>` from the repository root with its output in `log_path`; at the
    end stops it with SIGTERM (killed after 20 s) and prints its log's tail if it did not exit
    cleanly, so a failing test shows why the service failed."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if proc.returncode not in (0, -signal.SIGTERM):
        print(log_path.read_text()[-4000:])
