"""A stack's own certificate authority, for deployments that run TLS between machines without a
PKI of their own (`libra credentials DIR --tls`): one CA, a certificate per identity (what an
engine serves WeightSync with, and what every client presents to NATS and Redis), and one for each
server. The CA's key stays in the credentials root, never in a directory a service mounts."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825
"""How long a generated certificate is valid (the longest browsers accept, a common default)."""


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def create(cls, cn: str, days: int = VALID_DAYS) -> Authority:
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, directory: Path) -> Authority | None:
        """The CA kept in `directory` (ca.pem, ca-key.pem), or None when there is none."""
        cert, key = directory / "ca.pem", directory / "ca-key.pem"
        if not (cert.exists() and key.exists()):
            return None
        loaded = serialization.load_pem_private_key(key.read_bytes(), None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        return cls(x509.load_pem_x509_certificate(cert.read_bytes()), loaded)

    def save(self, directory: Path) -> None:
        _private(directory / "ca.pem", self.pem)
        _private(directory / "ca-key.pem", _key_pem(self.key))

    def issue(
        self,
        directory: Path,
        cn: str,
        hosts: Sequence[str],
        *,
        server: bool = True,
        client: bool = True,
        days: int = VALID_DAYS,
        stem: str = "",
    ) -> None:
        """Writes `<stem>cert.pem`, `<stem>key.pem` (0600) and `ca.pem` into `directory`: a
        certificate for `hosts` (DNS names, `*.` wildcards, IP addresses) signed by this CA."""
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        _private(directory / f"{stem}cert.pem", cert.public_bytes(serialization.Encoding.PEM))
        _private(directory / f"{stem}key.pem", _key_pem(key))
        _private(directory / "ca.pem", self.pem)
