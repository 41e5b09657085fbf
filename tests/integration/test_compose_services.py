"""Every Libra service of docker-compose.yml started as compose would start it, without a container
runtime (tests/deploy_rig.py): its own command, its compose environment, the credentials compose's
one-shot service writes (an identity per worker, the stack's CA) at the paths compose mounts them,
against nats-server and Redis started with compose's options (their healthchecks answering). Each
must come up, speak as its worker over mutual TLS and wait for a job; then a tiny job runs on them
as compose's job container runs it. What differs from a container: tests/deploy_rig.py."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common.credentials import HEALTH_USER, StackCredentials
from services.common.localstack import Server, start_redis
from services.common.runconfig import ModelConfig, load_run_config
from tests.deploy_rig import (
    COMPOSE,
    ROOT,
    UID,
    Nats,
    Workers,
    compose_credentials,
    compose_services,
    idle_workers,
    local_environment,
    readable_as,
    scheduler_roles,
    start_nats_as,
    tls_flags,
)
from tools.runner import run_job
from tools.stack import Stack

pytestmark = pytest.mark.integration

SERVICES = compose_services()


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    return compose_credentials(tmp_path_factory.mktemp("compose") / "secrets")


@pytest.fixture(scope="module")
def servers(
    creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Nats, Server]]:
    logs = tmp_path_factory.mktemp("logs")
    nats = start_nats_as(
        COMPOSE["services"]["nats"]["command"],
        {"/secrets": creds.root / "nats"},
        tmp_path_factory.mktemp("nats-data"),
        logs / "nats.log",
    )
    redis_server = start_redis(
        tmp_path_factory.mktemp("redis-data"), logs / "redis.log", config=creds.redis_conf
    )
    yield nats, redis_server
    nats.server.stop()
    redis_server.stop()


def _mounts(service: dict[str, Any], creds: StackCredentials, app: Path) -> dict[str, Path]:
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


def test_nats_and_redis_answer_their_compose_healthchecks(
    creds: StackCredentials, servers: tuple[Nats, Server]
) -> None:
    nats, redis_server = servers
    check = COMPOSE["services"]["nats"]["healthcheck"]["test"]
    assert check[:2] == ["CMD", "wget"] and nats.health(check[-1]) == 200
    probe = COMPOSE["services"]["redis"]["healthcheck"]["test"][1]
    assert f"--user {HEALTH_USER}" in probe and "--cert /secrets/health-cert.pem" in probe
    assert (creds.root / "redis" / "health-cert.pem").exists() and (
        creds.root / "redis" / "health-key.pem"
    ).exists()
    health = redis.Redis.from_url(redis_server.url, username=HEALTH_USER, password="unused")
    assert health.ping() is True
    with pytest.raises(redis.exceptions.NoPermissionError):  # PING is all it may do
        health.get("libra:any:trained")
    for service in SERVICES.values():  # the services wait for both to be healthy
        assert (
            service["depends_on"]["nats"]
            == service["depends_on"]["redis"]
            == {"condition": "service_healthy"}
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="reads files as another uid: needs root")
def test_each_service_reads_its_own_secrets_as_the_images_uid_and_no_other() -> None:
    """`libra credentials --owner 10001` as compose's one-shot service runs it (as root): each
    service's mounted directory is readable by uid 10001; the servers' keys and the CA's are not."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)  # a path uid 10001 may walk, as the bind mount's is
        _check_secrets_readable(Path(tmp))


def _check_secrets_readable(base: Path) -> None:
    creds = compose_credentials(base / "secrets", owner_uid=UID)
    for name, service in {**SERVICES, "job": COMPOSE["services"]["job"]}.items():
        mounted = [v.split(":")[0] for v in service["volumes"] if "compose-secrets" in v]
        for src in mounted:
            for f in (creds.root / src.rsplit("/", 1)[1]).iterdir():
                assert readable_as(UID, UID, f), (name, f)
    for server in ("nats", "redis"):
        assert not readable_as(UID, UID, creds.root / server / "server-key.pem"), server
    assert not readable_as(UID, UID, creds.root / "tls" / "ca-key.pem")


def test_every_compose_service_starts_as_compose_starts_it_and_runs_a_job(
    creds: StackCredentials, servers: tuple[Nats, Server], tmp_path: Path, tiny_model: ModelConfig
) -> None:
    """Up, idle, as its own worker; then `libra run` as compose's job runs it (the cli's
    credentials and TLS files) with the tiny config: every connection mutual TLS, the weight
    pushes to the engines included."""
    nats, redis_server = servers
    app = tmp_path / "app"
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = Workers(logs)
    try:
        for name, service in SERVICES.items():
            mounts = _mounts(service, creds, app)
            env = local_environment(
                {k: str(v) for k, v in service["environment"].items()}, mounts, nats, redis_server
            )
            if name.startswith("rollout-engine"):  # compose: its `hostname`, which its certificate names
                assert service["hostname"] == name
                env["LIBRA_ROLLOUT_ENGINE_ADVERTISE_HOST"] = "localhost"  # named by it too
            workers.start(name, service["command"], env, app)
        job = COMPOSE["services"]["job"]
        cli_tls = tls_flags(job["entrypoint"], {"/run/secrets/libra": creds.root})
        found = idle_workers(cli_tls, creds, nats.url, SERVICES, workers)
        data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
        data["training"]["steps"] = 2
        data["model"] = {**data.get("model", {}), "cache_dir": tiny_model.cache_dir}
        config = tmp_path / "tiny.yaml"
        config.write_text(yaml.safe_dump(data))
        stack = Stack.reached_at(nats.url, redis_server.url, creds.root, logs, tls=cli_tls)
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
        workers.stop()
    for name in SERVICES:  # each speaks as the worker its credentials name, of its own kind
        st = found[name]
        assert st.state == "idle" and name.startswith(st.service), (name, st.service, st.state)
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 2 and report["all_engines_on_final_version"], report["engines"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    # two schedulers: the planner gave one the job, the other stood by, warm
    schedulers = [n for n in SERVICES if n.startswith("scheduler")]
    assert scheduler_roles(logs, schedulers) == ["leading", "standing_by"], schedulers
