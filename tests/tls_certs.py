"""A throwaway CA and certificates for 127.0.0.1/localhost, for the TLS tests (made by the same
code as a stack's own CA, services/common/pki.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.pki import Authority


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca = Authority.create("libra-test-ca", days=1)
    ca.save(directory)
    loopback = ["localhost", "127.0.0.1"]
    ca.issue(directory, "server", loopback, client=False, days=1, stem="server-")
    ca.issue(directory, "client", loopback, server=False, days=1, stem="client-")
    d = directory
    return Certs(
        d / "ca.pem", d / "server-cert.pem", d / "server-key.pem", d / "client-cert.pem", d / "client-key.pem"
    )
