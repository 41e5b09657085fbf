"""Compose's TLS as compose runs it, without a container runtime: the credentials its one-shot
service writes (`libra credentials --tls --workers …`), nats-server started with compose's own
options (paths mapped from the container to here), and every Libra service's settings built
from its compose environment, connecting with its own certificate. What this cannot run — the
images, Redis over TLS (the embedded server has no TLS) — docs/deploy.md says."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

from services.common.bus import connect_nats
from services.common.config import CommonSettings, load_settings
from services.common.credentials import StackCredentials, generate
from services.common.errors import CredentialsRefused
from services.common.tls import TlsFiles
from tests.deploy_rig import (
    COMPOSE,
    Nats,
    certificate_names,
    compose_credentials,
    compose_services,
    start_nats_as,
    tls_flags,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    return compose_credentials(tmp_path_factory.mktemp("compose") / "secrets")


@pytest.fixture(scope="module")
def compose_nats(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nats]:
    """nats-server with compose's options: its /secrets mount is the credentials' nats/ here."""
    nats = start_nats_as(
        COMPOSE["services"]["nats"]["command"],
        {"/secrets": creds.root / "nats"},
        tmp_path_factory.mktemp("nats-data"),
        tmp_path_factory.mktemp("log") / "nats.log",
    )
    yield nats
    nats.server.stop()


def _settings(
    service: dict[str, Any], creds: StackCredentials, identity: str, monkeypatch: Any
) -> CommonSettings:
    """The service's settings as its container builds them, its secrets mount mapped here."""
    mount = next(v for v in service["volumes"] if "compose-secrets" in v).split(":")[1]
    for key in [k for k in os.environ if k.startswith("LIBRA_")]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        if key.startswith("LIBRA_"):
            monkeypatch.setenv(key, str(value).replace(mount, str(creds.identity_dir(identity))))
    return load_settings(CommonSettings)


async def test_every_compose_service_reaches_nats_over_mutual_tls_as_itself(
    creds: StackCredentials, compose_nats: Nats, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = compose_nats.url
    for name, service in compose_services().items():
        common = _settings(service, creds, name, monkeypatch)
        assert common.nats_url.startswith("tls://") and common.redis_url.startswith("rediss://"), name
        assert common.nats_auth() is not None and common.nats_auth().user == name  # type: ignore[union-attr]
        nc = await asyncio.wait_for(connect_nats(url, name, common.nats_auth(), common.nats_tls()), 15)
        await nc.close()
    # `docker compose run job`: libra run with the cli identity's files
    tls = tls_flags(COMPOSE["services"]["job"]["entrypoint"], {"/run/secrets/libra": creds.root})
    nc = await asyncio.wait_for(connect_nats(url, "cli", creds.nats_auth("cli"), tls.client_ssl()), 15)
    await nc.close()
    # the right password without a certificate of the stack's CA is refused
    no_cert = TlsFiles(str(creds.identity_dir("planner") / "ca.pem")).client_ssl()
    with pytest.raises(CredentialsRefused):
        await asyncio.wait_for(connect_nats(url, "no-cert", creds.nats_auth("planner"), no_cert), 15)


def test_certificates_name_what_compose_and_kubernetes_connect_to(creds: StackCredentials) -> None:
    assert {"nats", "nats.libra.svc"} <= certificate_names(creds.root / "nats" / "server-cert.pem")
    assert {"redis", "redis.libra.svc"} <= certificate_names(creds.root / "redis" / "server-cert.pem")
    engine = certificate_names(creds.identity_dir("rollout-engine-1") / "cert.pem")
    assert "rollout-engine-1" in engine and "*.rollout-engine.libra.svc" in engine  # its WeightSync host
    # the CA's key is in the root only, never in a directory a container mounts
    mounted = [v.split(":")[0] for s in COMPOSE["services"].values() for v in s.get("volumes", [])]
    assert "./.libra/compose-secrets/tls" not in mounted and (creds.root / "tls" / "ca-key.pem").exists()
    for d in creds.root.iterdir():
        if d.name != "tls" and d.is_dir():
            assert not (d / "ca-key.pem").exists(), d
    # written again (a restarted compose): the same CA and certificates
    before = (creds.identity_dir("trainer") / "cert.pem").read_bytes()
    generate(
        creds.root, workers=[i.name for i in creds.identities() if i.name != "cli"], tls_namespace="libra"
    )
    assert (creds.identity_dir("trainer") / "cert.pem").read_bytes() == before
