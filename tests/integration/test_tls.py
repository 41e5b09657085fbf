"""TLS by configuration, on real servers: NATS with mutual TLS, WeightSync over a secure gRPC port.
Certificates come from a throwaway CA made for the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.bus import Bus, connect_nats
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.errors import CredentialsRefused
from services.common.localstack import Server, start_nats
from services.common.runconfig import ModelConfig
from services.common.tls import TlsFiles
from services.trainer.weight_push import WeightPusher
from tests.tls_certs import Certs, make_certs
from tests.weight_rig import nudged_weights, weight_sync_rig
from tools.report import engine_versions

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_nats(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("nats-tls")
    conf = d / "nats.conf"
    conf.write_text(
        "tls {\n"
        f'  cert_file: "{certs.server_cert}"\n  key_file: "{certs.server_key}"\n'
        f'  ca_file: "{certs.ca}"\n  verify: true\n'  # clients must present a certificate too
        "}\n"
    )
    srv = start_nats(d / "data", d / "nats-server.log", config=conf)
    yield srv
    srv.stop()


def test_settings_take_tls_files_and_refuse_missing_ones(certs: Certs, tmp_path: Path) -> None:
    common = CommonSettings(
        tls_ca_file=str(certs.ca), tls_cert_file=str(certs.client_cert), tls_key_file=str(certs.client_key)
    )
    assert common.tls() == TlsFiles(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    assert common.nats_tls() is not None
    assert CommonSettings().tls() is None and CommonSettings().nats_tls() is None
    with pytest.raises(ValueError, match="not a file"):
        CommonSettings(tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="go together"):
        CommonSettings(tls_cert_file=str(certs.client_cert))


async def test_nats_over_mutual_tls(tls_nats: Server, certs: Certs, run_id: str) -> None:
    client = TlsFiles(str(certs.ca), str(certs.client_cert), str(certs.client_key)).client_ssl()
    a = await Bus.connect(tls_nats.url, run_id, "rollout-engine", "over-tls", tls=client)
    b = await Bus.connect(tls_nats.url, run_id, "b", "b", tls=client)
    got: list[ev.WorkerHello] = []

    async def on_hello(m: ev.WorkerHello, _: Any) -> None:
        got.append(m)

    await b.subscribe("worker.hello", ev.WorkerHello, on_hello)
    # Said again every second until heard: twice in clean-clone CI runs a single hello (sent right
    # after both connected) never arrived in 10 s, though every later test of the suite's buses
    # passed; what is tested here is that messages cross mutual TLS at all.
    async with asyncio.timeout(20):
        while not got:
            await a.publish("worker.hello", ev.WorkerHello(worker_id="over-tls"))
            await a.nc.flush()
            for _ in range(20):
                if got:
                    break
                await asyncio.sleep(0.05)
    assert got[0].worker_id == "over-tls"
    for bus in (a, b):
        await bus.close()
        await bus.nc.close()


async def test_nats_refuses_a_client_that_does_not_trust_it(tls_nats: Server, certs: Certs) -> None:
    other = make_certs(certs.ca.parent / "other")  # a CA that did not sign the server's certificate
    wrong = TlsFiles(str(other.ca), str(other.client_cert), str(other.client_key)).client_ssl()
    with pytest.raises(CredentialsRefused, match="TLS"):
        await asyncio.wait_for(connect_nats(tls_nats.url, "wrong-ca", tls=wrong), 15)


@pytest.fixture
async def tls_engine(
    tiny_model: ModelConfig, redis_server: Server, certs: Certs, run_id: str
) -> AsyncIterator[dict[str, Any]]:
    server_tls = TlsFiles(str(certs.ca), str(certs.server_cert), str(certs.server_key))
    async with weight_sync_rig(tiny_model, redis_server.url, run_id, tls=server_tls) as rig:
        yield rig


async def test_weight_push_over_tls(tls_engine: dict[str, Any], certs: Certs) -> None:
    engine, addr = tls_engine["engine"], tls_engine["addr"]
    weights = nudged_weights(tls_engine["backend"], 1)

    plaintext = WeightPusher("trainer-1", 1 << 20, retries=0)
    result = (await plaintext.push(weights, tls_engine["token"], [addr]))[addr]
    await plaintext.close()
    assert not result.in_sync and engine.version == 0, result

    secure = WeightPusher("trainer-1", 1 << 20, tls=TlsFiles(str(certs.ca)))
    result = (await secure.push(weights, tls_engine["token"], [addr]))[addr]
    await secure.close()
    assert (result.in_sync, result.code) == (True, "ok"), result
    assert engine.version == 1


async def test_libra_run_asks_engines_over_tls_when_given_the_ca(
    tls_engine: dict[str, Any], certs: Certs
) -> None:
    """The operator's last question to the engines (their weight version) goes over TLS, with the
    CA `libra run --tls-ca-file` names; in plaintext the engine does not answer."""
    addr = tls_engine["addr"]
    st = ev.WorkerStatus(worker_id="engine-tls", service="rollout-engine")
    plan = ev.Plan(assignments=[ev.Assignment(worker_id="engine-tls", role="rollout", weight_sync_addr=addr)])
    (plain,) = await engine_versions([st], plan, token=None)
    assert plain["weight_version"] is None and plain["error"], plain
    (secure,) = await engine_versions([st], plan, token=None, tls=TlsFiles(str(certs.ca)))
    assert secure["weight_version"] == 0 and "error" not in secure, secure
