"""Per-stack credentials and who may publish what.

`generate` writes one directory per identity (each service kind, and `cli` for the operator's
`libra run`), holding only that identity's secrets as files named after the settings they fill
(`libra_nats_password`, ...), so `LIBRA_SECRETS_DIR=<dir>/<identity>` is all a process needs — the
same layout a Kubernetes Secret or a compose secret mounts. Beside them, `nats/nats.conf` holds the
NATS users with per-identity publish permissions (only the planner publishes plans, only the
scheduler completed trajectories, only the trainer weight updates and train metrics) and
`redis/redis.conf` the Redis password. Nothing here ever prints a secret.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.common import subjects

SERVICES = ("planner", "scheduler", "rollout-engine", "trainer", "tool-sandbox")
IDENTITIES = (*SERVICES, "cli")
NATS_MAX_PAYLOAD = 8 << 20
"""Largest NATS message the stack accepts (a 64k-token trajectory with logprobs is about 0.6 MB)."""

_RUN = "libra.v1.*"
_COMMON = ("worker.hello", "errors")
_PUBLISHES: dict[str, tuple[str, ...]] = {
    "planner": (subjects.PLAN, subjects.ROLE_CHANGE, subjects.FACTS_PLANNER),
    "scheduler": (
        f"{subjects.TURN_REQUEST}.*",
        subjects.TOOL_CALL,
        subjects.TRAJ_COMPLETED,
        subjects.WORKLOAD_STATS,
        subjects.FACTS_SCHEDULER,
    ),
    "rollout-engine": (subjects.TURN_RESULT, subjects.ENGINE_LOAD, subjects.HYBRID_STATE),
    "tool-sandbox": (subjects.TOOL_RETURN,),
    "trainer": (
        subjects.WEIGHTS_UPDATED,
        subjects.TRAIN_METRICS,
        subjects.GROUP_OUTCOME,
        subjects.HYBRID_STATE,
        subjects.HYBRID_GROUP,
        subjects.FACTS_TRAINER,
    ),
    "cli": (subjects.SCHEDULER_STATS, subjects.ROLE_REQUEST),
}
_JS_DESTRUCTIVE = (
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.CONSUMER.DELETE.>",
)


def publish_allowed(identity: str) -> list[str]:
    """The subjects `identity` may publish to. Replies go to `_INBOX.>` (nats-server's
    `allow_responses` breaks when one connection has two subscriptions matching a request)."""
    run_scoped = [*_PUBLISHES[identity]]
    if identity != "cli":
        run_scoped += [*_COMMON, f"{subjects.METRICS}.{identity}"]
    out = [f"{_RUN}.{s}" for s in run_scoped]
    out += ["$JS.API.>", "$JS.ACK.>", "_INBOX.>"]
    # the control plane: the operator starts, stops and polls jobs; services report heartbeats
    ctl = "libra.ctl.v1"
    out += (
        [f"{ctl}.job.start", f"{ctl}.job.stop", f"{ctl}.status"]
        if identity == "cli"
        else [f"{ctl}.heartbeat"]
    )
    return out


def publish_denied(identity: str) -> list[str]:
    """Engines and sandboxes run model output and tool code next door: they cannot delete history."""
    return list(_JS_DESTRUCTIVE) if identity in ("rollout-engine", "tool-sandbox") else []


@dataclass(frozen=True)
class NatsAuth:
    user: str
    password: str


@dataclass(frozen=True)
class StackCredentials:
    """Where `generate` put a stack's credentials; paths only."""

    root: Path

    def identity_dir(self, identity: str) -> Path:
        return self.root / identity

    @property
    def nats_conf(self) -> Path:
        return self.root / "nats" / "nats.conf"

    @property
    def redis_conf(self) -> Path:
        return self.root / "redis" / "redis.conf"

    def read(self, identity: str, name: str) -> str:
        return (self.identity_dir(identity) / name).read_text().strip()

    def nats_auth(self, identity: str) -> NatsAuth:
        return NatsAuth(self.read(identity, "libra_nats_user"), self.read(identity, "libra_nats_password"))

    def redis_password(self) -> str:
        return self.read("cli", "libra_redis_password")

    def weight_sync_token(self) -> str:
        return self.read("cli", "libra_weight_sync_token")


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)


def nats_config(passwords: dict[str, str]) -> str:
    """nats-server configuration: one user per identity with its publish permissions."""
    users = []
    for identity, password in passwords.items():
        publish: dict[str, list[str]] = {"allow": publish_allowed(identity)}
        if publish_denied(identity):
            publish["deny"] = publish_denied(identity)
        perms = {"publish": publish, "subscribe": {"allow": [">"]}}
        users.append({"user": identity, "password": password, "permissions": perms})
    # JSON is valid nats-server configuration syntax
    body = json.dumps({"users": users}, indent=2)
    return f"max_payload: {NATS_MAX_PAYLOAD}\nauthorization: {body}\n"


def generate(root: Path, owner_uid: int | None = None) -> StackCredentials:
    """Creates fresh credentials under `root` (mode 0700), or keeps the ones already there: a
    restarted stack keeps talking to the Redis data and NATS streams it wrote before. With
    `owner_uid` (run as root, e.g. compose's one-shot `credentials` service) the identities'
    directories are handed to the uid the service images run as; nats and redis stay root's."""
    creds = StackCredentials(root)
    complete = creds.nats_conf.exists() and all(
        (creds.identity_dir(i) / "libra_nats_password").exists() for i in IDENTITIES
    )
    if not complete:
        _write_all(creds)
    if owner_uid is not None:
        for identity in IDENTITIES:
            d = creds.identity_dir(identity)
            for path in (d, *d.iterdir()):
                os.chown(path, owner_uid, owner_uid)
        os.chmod(root, 0o711)  # the services reach their own directory and list nothing
    return creds


def _write_all(creds: StackCredentials) -> None:
    creds.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(creds.root, 0o700)
    redis_password = secrets.token_urlsafe(24)
    token = secrets.token_urlsafe(32)
    passwords = {i: secrets.token_urlsafe(24) for i in IDENTITIES}
    for identity in IDENTITIES:
        d = creds.identity_dir(identity)
        _write_secret(d / "libra_nats_user", identity)
        _write_secret(d / "libra_nats_password", passwords[identity])
        _write_secret(d / "libra_redis_password", redis_password)
        if identity in ("rollout-engine", "trainer", "cli"):
            _write_secret(d / "libra_weight_sync_token", token)
    _write_secret(creds.nats_conf, nats_config(passwords))
    _write_secret(creds.redis_conf, f"requirepass {redis_password}\n")


def k8s_secrets(creds: StackCredentials, namespace: str) -> list[dict[str, object]]:
    """Kubernetes Secrets holding `creds`, as deploy/k8s mounts them: `libra-<identity>-credentials`
    per service (files named like the settings), `libra-nats-config` and `libra-redis-config`."""

    def secret(name: str, files: dict[str, str]) -> dict[str, object]:
        meta = {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "libra"}}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "stringData": files}

    out = [
        secret("libra-nats-config", {"nats.conf": creds.nats_conf.read_text()}),
        secret("libra-redis-config", {"redis.conf": creds.redis_conf.read_text()}),
    ]
    for identity in IDENTITIES:
        files = {f.name: f.read_text() for f in sorted(creds.identity_dir(identity).iterdir())}
        out.append(secret(f"libra-{identity}-credentials", files))
    return out
