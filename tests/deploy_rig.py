"""Starting the stack as a deployment file describes it, without a container runtime: the
credentials as compose's one-shot service or `libra credentials --k8s-namespace` writes them, the
files a container mounts at the paths its environment names (mapped to directories here), NATS
and Redis with the file's own options, every Libra service with its own command and environment,
and `libra run` as the job container runs it. What differs from a container, and why
(docs/deploy.md): processes run as this user (the interpreter here is not reachable by uid
10001; `readable_as` checks the secrets' modes for that uid instead); hostnames and fixed ports
become loopback and free ports; Redis is plaintext (the embedded Redis-compatible server has no
TLS); no Jaeger."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509

from services.common import control
from services.common.bus import close_nats
from services.common.credentials import StackCredentials, generate
from services.common.localstack import Server, free_port, start_nats
from services.common.tls import TlsFiles

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
K8S_DIR = ROOT / "deploy" / "k8s"
UID = 10001
"""The uid the images run as (deploy/docker/Dockerfile*, compose's `--owner`, k8s `runAsUser`)."""


def compose_services() -> dict[str, dict[str, Any]]:
    """The Libra services of docker-compose.yml (the one-shot credentials and the job excepted)."""
    return {n: s for n, s in COMPOSE["services"].items() if "build" in s and n not in ("credentials", "job")}


def compose_credentials(root: Path, owner_uid: int | None = None) -> StackCredentials:
    """What compose's one-shot `credentials` service writes (`--owner` only when asked for)."""
    cmd = COMPOSE["services"]["credentials"]["command"]
    assert cmd[:3] == ["libra", "credentials", "/secrets"] and "--tls" in cmd
    workers = cmd[cmd.index("--workers") + 1].split(",")
    return generate(root, workers=workers, owner_uid=owner_uid, tls_namespace="libra")


def map_paths(value: str, mounts: dict[str, Path]) -> str:
    """`value` with every container path under a mount replaced by the directory here."""
    for dst in sorted(mounts, key=len, reverse=True):
        value = re.sub(rf"(?<![\w/.-]){re.escape(dst)}(?=/|$|\s|\?)", str(mounts[dst]), value)
    return value


@dataclass
class Nats:
    server: Server
    monitor_port: int

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"

    def health(self, check_url: str) -> int:
        """The HTTP status of the file's healthcheck URL, its loopback port mapped here."""
        import urllib.request

        url = check_url.replace("127.0.0.1:8222", f"127.0.0.1:{self.monitor_port}")
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)


def start_nats_as(args: list[str], mounts: dict[str, Path], data: Path, log: Path) -> Nats:
    """nats-server with a deployment's options, its mounts mapped here. JetStream's storage is
    the test's own, and the monitor's fixed loopback port (server.conf) a free one."""
    argv = list(args)
    for option in ("-js", "-sd", "/data"):
        argv.remove(option)
    argv = [map_paths(a, mounts) for a in argv]
    conf = Path(argv[argv.index("-c") + 1])
    port = free_port()
    local = conf.with_name("server-local.conf")
    text = conf.read_text()
    assert "http: 127.0.0.1:8222" in text, "the monitor listens on the container's loopback only"
    local.write_text(text.replace("127.0.0.1:8222", f"127.0.0.1:{port}"))
    argv[argv.index("-c") + 1] = str(local)
    return Nats(start_nats(data, log, extra=argv), port)


@dataclass
class Workers:
    """Processes started as a deployment file starts them; stopped by `stop`."""

    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, command: list[str], env: dict[str, str], cwd: Path) -> None:
        assert command[:2] == ["python", "-m"], (name, command)
        cwd.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *command[1:]], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited with {p.returncode}:\n{tail}")

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def local_environment(
    env: dict[str, str], mounts: dict[str, Path], nats: Nats, redis: Server
) -> dict[str, str]:
    """A container's Libra environment for a process here: mount paths mapped, NATS and Redis on
    loopback (Redis plaintext: see the module's docstring), free ports, no OTLP export."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    out.update({k: map_paths(v, mounts) for k, v in env.items()})
    assert out["LIBRA_NATS_URL"].startswith("tls://") and out["LIBRA_REDIS_URL"].startswith("rediss://")
    out["LIBRA_NATS_URL"] = nats.url
    out["LIBRA_REDIS_URL"] = redis.url
    out.pop("LIBRA_OTLP_ENDPOINT")
    out["LIBRA_METRICS_PORT"] = str(free_port())
    out["LIBRA_METRICS_ADDR"] = "127.0.0.1"
    for port in ("LIBRA_ROLLOUT_ENGINE_GRPC_PORT", "LIBRA_TRAINER_HYBRID_PORT"):
        if port in out:
            out[port] = str(free_port())
    out["PYTHONPATH"] = str(ROOT)
    return out


def certificate_names(cert: Path) -> set[str]:
    pem = x509.load_pem_x509_certificate(cert.read_bytes())
    sans = pem.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(sans.get_values_for_type(x509.DNSName))


def certifies(cert: Path, host: str) -> bool:
    """Whether `cert` names `host` (a `*.` wildcard stands for one label, as TLS clients match)."""
    for name in certificate_names(cert):
        if name == host or (name.startswith("*.") and host.split(".", 1)[-1] == name[2:] and "." in host):
            return True
    return False


async def _discover(
    tls: TlsFiles, creds: StackCredentials, url: str, want: set[str], workers: Workers
) -> dict[str, Any]:
    nc = await control.connect(url, "deploy-test", creds.nats_auth("cli"), tls.client_ssl())
    try:
        deadline = time.monotonic() + 150
        found: dict[str, Any] = {}
        while time.monotonic() < deadline:
            workers.check_alive()
            found = {st.worker_id: st for st in await control.discover(nc, 0.5)}
            if want <= set(found):
                return found
        raise AssertionError(f"not up in time: {sorted(want - set(found))}")
    finally:
        await close_nats(nc)


def idle_workers(
    tls: TlsFiles, creds: StackCredentials, url: str, want: Iterable[str], workers: Workers
) -> dict[str, Any]:
    """Each worker in `want` as its heartbeat reports it, once all are up (the operator's view)."""
    return asyncio.run(_discover(tls, creds, url, set(want), workers))


def scheduler_roles(logs: Path, names: Iterable[str]) -> list[str]:
    """What each scheduler did in the job, from its log: `leading` or `standing_by` (sorted)."""
    said = []
    for name in names:
        text = (logs / f"{name}.log").read_text(errors="replace")
        said += [e for e in ("leading", "standing_by") if f"scheduler_{e}" in text]
    return sorted(said)


def tls_flags(argv: list[str], mounts: dict[str, Path]) -> TlsFiles:
    """The `--tls-*` files of a `libra run` command line, mapped here."""
    files = {f: map_paths(argv[argv.index(f) + 1], mounts) for f in argv if f.startswith("--tls-")}
    return TlsFiles(files["--tls-ca-file"], files["--tls-cert-file"], files["--tls-key-file"])


def readable_as(uid: int, gid: int, path: Path) -> bool:
    """Whether `path` is readable by `uid` in group `gid` (run as root only: `test -r` as that user)."""
    return (
        subprocess.run(
            ["test", "-r", str(path)], user=uid, group=gid, extra_groups=[gid], check=False
        ).returncode
        == 0
    )
