"""Every Libra service of docker-compose.yml started as compose would start it, without a container
runtime: its own command, its compose environment, the credentials compose's one-shot service
writes (an identity per worker, the stack's CA) at the paths compose mounts them, against
nats-server started with compose's options. Each must come up, speak as its worker over mutual
TLS and wait for a job; then a tiny job runs on them as compose's job container runs it. What
differs from a container, and why (docs/deploy.md): processes run as
this user, not uid 10001 (the interpreter here is not reachable by another uid); hostnames and
fixed ports are loopback and free ports (one network here, one per container there); Redis is
plaintext (the embedded Redis-compatible server has no TLS); no Jaeger."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common import control
from services.common.bus import close_nats
from services.common.credentials import StackCredentials, generate
from services.common.localstack import Server, free_port, start_nats, start_redis
from services.common.runconfig import ModelConfig, load_run_config
from services.common.tls import TlsFiles
from tools.runner import run_job
from tools.stack import Stack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = {n: s for n, s in COMPOSE["services"].items() if "build" in s and n not in ("credentials", "job")}


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    cmd = COMPOSE["services"]["credentials"]["command"]
    workers = cmd[cmd.index("--workers") + 1].split(",")
    return generate(tmp_path_factory.mktemp("compose") / "secrets", workers=workers, tls_namespace="libra")


@pytest.fixture(scope="module")
def servers(
    creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    cmd = [c.replace("/secrets", str(creds.root / "nats")) for c in COMPOSE["services"]["nats"]["command"]]
    for option in ("-js", "-sd", "/data"):
        cmd.remove(option)
    logs = tmp_path_factory.mktemp("logs")
    nats = start_nats(tmp_path_factory.mktemp("nats-data"), logs / "nats.log", extra=cmd)
    redis = start_redis(tmp_path_factory.mktemp("redis-data"), logs / "redis.log", config=creds.redis_conf)
    yield nats, redis
    nats.stop()
    redis.stop()


def _local(service: dict[str, Any], creds: StackCredentials, app: Path) -> dict[str, Path]:
    """Each of the service's mounts (container path → path here)."""
    out = {}
    for volume in service.get("volumes", []):
        src, dst = volume.split(":")[:2]
        if src.startswith("./.libra/compose-secrets/"):
            out[dst] = creds.root / src.rsplit("/", 1)[1]
        elif src.startswith("./"):
            out[dst] = ROOT / src[2:] if (ROOT / src[2:]).exists() else app / src[2:]
        else:  # a named volume
            out[dst] = app / "volumes" / src
        out[dst].mkdir(parents=True, exist_ok=True)
    return out


def _environment(
    name: str, service: dict[str, Any], mounts: dict[str, Path], servers: tuple[Server, Server]
) -> dict[str, str]:
    nats, redis = servers
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    for key, value in service["environment"].items():
        value = str(value)
        for dst in sorted(mounts, key=len, reverse=True):
            value = value.replace(dst, str(mounts[dst]))
        env[key] = value
    assert env["LIBRA_NATS_URL"] == "tls://nats:4222" and env["LIBRA_REDIS_URL"] == "rediss://redis:6379/0"
    env["LIBRA_NATS_URL"] = f"tls://127.0.0.1:{nats.port}"
    env["LIBRA_REDIS_URL"] = redis.url  # plaintext: see the module's docstring
    env.pop("LIBRA_OTLP_ENDPOINT")
    env["LIBRA_METRICS_PORT"] = str(free_port())
    env["LIBRA_METRICS_ADDR"] = "127.0.0.1"
    for port in ("LIBRA_ROLLOUT_ENGINE_GRPC_PORT", "LIBRA_TRAINER_HYBRID_PORT"):
        if port in env:
            env[port] = str(free_port())
    if name.startswith("rollout-engine"):  # compose: its `hostname`, which its certificate names
        assert service["hostname"] == name
        env["LIBRA_ROLLOUT_ENGINE_ADVERTISE_HOST"] = "localhost"  # named by it too
    env["PYTHONPATH"] = str(ROOT)
    return env


async def _idle_workers(
    cli_tls: TlsFiles,
    creds: StackCredentials,
    url: str,
    want: set[str],
    procs: dict[str, subprocess.Popen[bytes]],
    logs: Path,
) -> dict[str, Any]:
    nc = await control.connect(url, "compose-test", creds.nats_auth("cli"), cli_tls.client_ssl())
    try:
        deadline = time.monotonic() + 150
        found: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for name, p in procs.items():
                if p.poll() is not None:
                    tail = (logs / f"{name}.log").read_text()[-3000:]
                    raise AssertionError(f"{name} exited with {p.returncode}:\n{tail}")
            found = {st.worker_id: st for st in await control.discover(nc, 0.5)}
            if want <= set(found):
                return found
        raise AssertionError(f"not up in time: {sorted(want - set(found))}")
    finally:
        await close_nats(nc)


def test_every_compose_service_starts_as_compose_starts_it_and_runs_a_job(
    creds: StackCredentials, servers: tuple[Server, Server], tmp_path: Path, tiny_model: ModelConfig
) -> None:
    """Up, idle, as its own worker; then `libra run` as compose's job runs it (the cli's
    credentials and TLS files) with the tiny config: every connection mutual TLS, the weight
    pushes to the engines included."""
    app = tmp_path / "app"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, service in SERVICES.items():
            mounts = _local(service, creds, app)
            command = service["command"]
            assert command[:2] == ["python", "-m"], name
            with open(logs / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, *command[1:]],
                    cwd=app,
                    env=_environment(name, service, mounts, servers),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        job = COMPOSE["services"]["job"]["entrypoint"]
        files = {
            f: job[job.index(f) + 1].replace("/run/secrets/libra", str(creds.root))
            for f in job
            if f.startswith("--tls-")
        }
        cli_tls = TlsFiles(files["--tls-ca-file"], files["--tls-cert-file"], files["--tls-key-file"])
        url = f"tls://127.0.0.1:{servers[0].port}"
        found = asyncio.run(_idle_workers(cli_tls, creds, url, set(SERVICES), procs, logs))
        data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
        data["training"]["steps"] = 2
        data["model"] = {**data.get("model", {}), "cache_dir": tiny_model.cache_dir}
        config = tmp_path / "tiny.yaml"
        config.write_text(yaml.safe_dump(data))
        stack = Stack.reached_at(url, servers[1].url, creds.root, logs, tls=cli_tls)
        report = run_job(
            config,
            load_run_config(config),
            run_id="compose-tiny",
            runs_dir=tmp_path / "runs",
            timeout_s=300,
            progress=False,
            stack=stack,
        )
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    for name in SERVICES:  # each speaks as the worker its credentials name, of its own kind
        st = found[name]
        assert st.state == "idle" and name.startswith(st.service), (name, st.service, st.state)
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 2 and report["all_engines_on_final_version"], report["engines"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
