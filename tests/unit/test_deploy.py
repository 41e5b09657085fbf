"""Static checks of what cannot run here (no Docker engine, no cluster): the images, compose file and
manifests must parse, pass their linters, and run exactly the commands `libra up` runs natively."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.stack import service_commands

ROOT = Path(__file__).resolve().parents[2]
NATIVE = {("python", "-m", module) for _, module in service_commands(1)}


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is a dev dependency and should be installed")
    return found


def test_compose_runs_native_commands_for_every_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    commands = {tuple(s["command"]) for s in compose["services"].values() if "build" in s}
    assert commands == NATIVE
    for name, svc in compose["services"].items():
        if "build" in svc:
            env = svc["environment"]
            assert env["LIBRA_NATS_URL"].startswith("nats://") and env["LIBRA_OTLP_ENDPOINT"], name
    assert "jaeger" in compose["services"]


def test_k8s_manifests_validate_and_run_native_commands() -> None:
    files = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
    out = subprocess.run(
        [_bin("kubernetes-validate"), "-k", "1.30.0", *map(str, files)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    commands = set()
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if "command" in c:
                        commands.add(tuple(c["command"]))
    assert commands == NATIVE


def test_dockerfiles_pass_hadolint() -> None:
    files = sorted((ROOT / "deploy" / "docker").glob("Dockerfile*"))
    out = subprocess.run([_bin("hadolint"), *map(str, files)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    for _, module in service_commands(1):
        assert f'CMD ["python", "-m", "{module}"]' in text
