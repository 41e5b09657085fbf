"""TLS by configuration, for stacks whose services talk across machines.

One trust anchor (`LIBRA_TLS_CA_FILE`) verifies the servers a process connects to: NATS, Redis
(`rediss://` URLs) and the engines' WeightSync. A process's own certificate (`LIBRA_TLS_CERT_FILE`,
`LIBRA_TLS_KEY_FILE`) is what an engine serves WeightSync with, and what every client presents
where a server asks for one (mutual TLS). Unset, everything stays plaintext, as on one host where
`libra up` binds loopback only.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback: what no other machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} {path} is not a file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS cert_file and key_file go together")

    def client_ssl(self) -> ssl.SSLContext | None:
        """For NATS and Redis: verifies the server against the CA, presents our certificate if any."""
        if self.ca_file is None:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def server_ssl(self) -> ssl.SSLContext | None:
        """For an HTTPS server (the scheduler's agent endpoint): serves our certificate (None
        without one)."""
        if not (self.cert_file and self.key_file):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def redis_options(self, url: str) -> dict[str, Any]:
        if not url.startswith("rediss://") or self.ca_file is None:
            return {}
        return {"ssl_ca_certs": self.ca_file, "ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}

    def grpc_server_credentials(self) -> grpc.ServerCredentials | None:
        if not (self.cert_file and self.key_file):
            return None
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        return grpc.ssl_server_credentials([pair])

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca_file is None:
            return None
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(Path(self.ca_file).read_bytes(), key, cert)


def grpc_channel(
    addr: str, tls: TlsFiles | None, options: list[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A secure channel when a CA is configured, else a plaintext one."""
    creds = tls.grpc_channel_credentials() if tls is not None else None
    if creds is None:
        return grpc.aio.insecure_channel(addr, options=options)
    return grpc.aio.secure_channel(addr, creds, options=options)
