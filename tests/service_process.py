"""One service as a real process for an integration test: `python -m services.<name>`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def pinned_job_env(
    tmp_path: Path,
    run: dict[str, Any],
    nats_url: str,
    redis_url: str,
    run_id: str,
    worker_id: str,
    **settings: str,
) -> dict[str, str]:
    """The environment of a service pinned to one job: `run` written as its LIBRA_CONFIG under
    `tmp_path`, the stack's addresses (the test session's, without authentication: insecure), and
    `settings` (LIBRA_<SERVICE>_... variables)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    return dict(
        os.environ,
        LIBRA_NATS_URL=nats_url,
        LIBRA_REDIS_URL=redis_url,
        LIBRA_RUN_ID=run_id,
        LIBRA_CONFIG=str(config),
        LIBRA_WORKER_ID=worker_id,
        LIBRA_INSECURE="1",
        HF_HUB_OFFLINE="1",
        **settings,
    )


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
