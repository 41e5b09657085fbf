"""Per-stack credentials and who may publish what.

`generate` writes one directory per identity (each service kind, and `cli` for the operator's
`libra run`), holding only that identity's secrets as files named after the settings they fill
(`libra_nats_password`, ...), so `LIBRA_SECRETS_DIR=<dir>/<identity>` is all a process needs — the
same layout a Kubernetes Secret or a compose secret mounts. Beside them, `nats/nats.conf` holds the
NATS users, each allowed only what its role needs (docs/security.md has the table): the subjects it
owns to publish (only the planner plans, only the scheduler completed trajectories, only the
trainer weight updates), the events it consumes to subscribe, its own durable consumer to pull, the
last-value subjects it reads, its own reply inbox, and replies only to requests it received; the
JetStream API that makes streams and consumers only for the operator's `cli`. `redis/redis.conf`
holds a Redis ACL user per identity, allowed only its own keys (no default user). Nothing here
ever prints a secret.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.common import subjects
from services.common.streams import SCHEDULER_FEED, TRAINER_FEED

SERVICES = ("planner", "scheduler", "rollout-engine", "trainer", "tool-sandbox")
IDENTITIES = (*SERVICES, "cli")
NATS_MAX_PAYLOAD = 8 << 20
"""Largest NATS message the stack accepts (a 64k-token trajectory with logprobs is about 0.6 MB)."""

_RUN = "libra.v1.*"
_CTL = "libra.ctl.v1"
_JS = "$JS.API"
_COMMON = ("worker.hello", "errors")


@dataclass(frozen=True)
class Grants:
    """What one identity may do on NATS; run-scoped subjects are suffixes of `libra.v1.<run>.`."""

    publishes: tuple[str, ...] = ()
    subscribes: tuple[str, ...] = ()
    pulls: tuple[str, ...] = ()
    """Durable consumers (services/common/streams.py) it may fetch from and acknowledge."""
    reads: tuple[str, ...] = (subjects.PLAN,)
    """Last-value subjects it may read from their streams (a direct get by subject)."""


_GRANTS: dict[str, Grants] = {
    "planner": Grants(
        publishes=(subjects.PLAN, subjects.ROLE_CHANGE, subjects.FACTS_PLANNER),
        subscribes=(
            subjects.WORKER_HELLO,
            subjects.WORKLOAD_STATS,
            subjects.TRAIN_METRICS,
            subjects.ROLE_REQUEST,
            subjects.HYBRID_STATE,
        ),
    ),
    "scheduler": Grants(
        publishes=(
            f"{subjects.TURN_REQUEST}.*",
            subjects.TOOL_CALL,
            subjects.TRAJ_COMPLETED,
            subjects.WORKLOAD_STATS,
            subjects.FACTS_SCHEDULER,
        ),
        subscribes=(
            subjects.PLAN,
            subjects.TURN_RESULT,
            subjects.TOOL_RETURN,
            subjects.ENGINE_LOAD,
            subjects.WEIGHTS_UPDATED,
            subjects.SCHEDULER_STATS,
        ),
        pulls=(SCHEDULER_FEED.durable,),
        reads=(subjects.PLAN, subjects.FACTS_TRAINER),
    ),
    "rollout-engine": Grants(
        publishes=(subjects.TURN_RESULT, subjects.ENGINE_LOAD, subjects.HYBRID_STATE),
        subscribes=(subjects.PLAN, f"{subjects.TURN_REQUEST}.*", subjects.HYBRID_GROUP),
    ),
    "tool-sandbox": Grants(publishes=(subjects.TOOL_RETURN,), subscribes=(subjects.PLAN, subjects.TOOL_CALL)),
    "trainer": Grants(
        publishes=(
            subjects.WEIGHTS_UPDATED,
            subjects.TRAIN_METRICS,
            subjects.GROUP_OUTCOME,
            subjects.HYBRID_STATE,
            subjects.HYBRID_GROUP,
            subjects.FACTS_TRAINER,
        ),
        subscribes=(subjects.PLAN, subjects.HYBRID_STATE),
        pulls=(TRAINER_FEED.durable,),
    ),
    "cli": Grants(
        publishes=(subjects.SCHEDULER_STATS, subjects.ROLE_REQUEST),
        subscribes=(">",),  # the operator watches its jobs: every run subject
        reads=(">",),
    ),
}
_CLI_JS = (  # the control identity: a run's streams and consumers, made, read and deleted
    f"{_JS}.INFO",
    f"{_JS}.STREAM.CREATE.*",
    f"{_JS}.STREAM.UPDATE.*",
    f"{_JS}.STREAM.INFO.*",
    f"{_JS}.STREAM.DELETE.*",
    f"{_JS}.CONSUMER.CREATE.*.>",
    f"{_JS}.CONSUMER.INFO.*.*",
)


_REDIS_COMMANDS = "-@all +@read +@write +@scripting +@connection +@transaction +select -@dangerous"
_REDIS_KEYS: dict[str, tuple[str, ...]] = {
    # `~` read and write, `%R~` read only; keys are libra:<run>:… (services/common/ownership.py)
    "planner": ("~libra:*:lease:*", "~libra:*:fence:*", "~libra:*:plans", "~libra:*:role_changes"),
    "trainer": (
        "~libra:*:trainer:*",
        "~libra:*:trained",
        "~libra:*:lease:role:trainer",
        "~libra:*:lease:worker:*",
        "%R~libra:*:lease:*",
    ),
    "scheduler": ("~libra:*:scheduler:*", "~libra:*:lease:worker:*", "%R~libra:*:lease:*"),
    "rollout-engine": ("~libra:*:lease:worker:*", "%R~libra:*:lease:*"),
    "tool-sandbox": ("~libra:*:lease:worker:*", "%R~libra:*:lease:*"),
    "cli": ("%R~libra:*",),
}
"""Each identity's Redis keys: the planner leases and fences workers and keeps the plan history,
the trainer its commit record and trained set, the scheduler its ledger; a worker renews (and
releases) worker leases and reads the others; the operator reads."""


def redis_acl(identity: str, password: str) -> str:
    """The Redis ACL line of `identity` (redis.conf `user` directive)."""
    return " ".join(
        ("user", identity, "on", f">{password}", "resetchannels", *_REDIS_KEYS[identity], _REDIS_COMMANDS)
    )


def inbox_prefix(identity: str) -> str:
    """Where `identity`'s replies come (JetStream's included): only it may subscribe there."""
    return f"_INBOX_{identity}"


def publish_allowed(identity: str) -> list[str]:
    """The subjects `identity` may publish to. Replies to requests it received are allowed by
    `allow_responses` (nats_config), to those requests' reply subjects only; no other inbox."""
    g = _GRANTS[identity]
    run_scoped = [*g.publishes]
    if identity != "cli":
        run_scoped += [*_COMMON, f"{subjects.METRICS}.{identity}"]
    out = [f"{_RUN}.{s}" for s in run_scoped]
    for durable in g.pulls:
        out += [
            f"{_JS}.CONSUMER.INFO.*.{durable}",
            f"{_JS}.CONSUMER.MSG.NEXT.*.{durable}",
            f"$JS.ACK.*.{durable}.>",
        ]
    out += [f"{_JS}.DIRECT.GET.*.{_RUN}.{s}" for s in g.reads]
    # a service waits for the streams it uses (their configuration and counts, never their messages)
    out += [*_CLI_JS] if identity == "cli" else [f"{_JS}.STREAM.INFO.*"]
    # the control plane: the operator starts, stops and polls jobs; services report heartbeats
    out += (
        [f"{_CTL}.job.start", f"{_CTL}.job.stop", f"{_CTL}.status"]
        if identity == "cli"
        else [f"{_CTL}.heartbeat"]
    )
    return out


def subscribe_allowed(identity: str) -> list[str]:
    """The subjects `identity` may subscribe to: the events its role consumes, its own inbox, and
    the control plane's (services: job start, stop and status; the operator: heartbeats)."""
    run = [f"{_RUN}.{s}" for s in _GRANTS[identity].subscribes]
    ctl = (
        [f"{_CTL}.heartbeat"]
        if identity == "cli"
        else [f"{_CTL}.job.start", f"{_CTL}.job.stop", f"{_CTL}.status"]
    )
    return [*run, *ctl, f"{inbox_prefix(identity)}.>"]


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

    def redis_auth(self, identity: str = "cli") -> dict[str, str]:
        """redis-py's `username` and `password` of `identity`'s Redis ACL user."""
        return {
            "username": self.read(identity, "libra_redis_user"),
            "password": self.read(identity, "libra_redis_password"),
        }

    def weight_sync_token(self) -> str:
        return self.read("cli", "libra_weight_sync_token")


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)


def nats_config(passwords: dict[str, str]) -> str:
    """nats-server configuration: one user per identity with its publish and subscribe permissions."""
    users = []
    for identity, password in passwords.items():
        perms = {
            "publish": {"allow": publish_allowed(identity)},
            "subscribe": {"allow": subscribe_allowed(identity)},
            # a reply to a request this user received, once, within a minute; never another inbox.
            # (nats-server refuses such a reply when one connection holds two subscriptions that
            # match the request: every responder here subscribes to a request subject once.)
            "allow_responses": {"max": 1, "expires": "1m"},
        }
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
        (creds.identity_dir(i) / name).exists()
        for i in IDENTITIES
        for name in ("libra_nats_password", "libra_redis_user")
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
    token = secrets.token_urlsafe(32)
    passwords = {i: secrets.token_urlsafe(24) for i in IDENTITIES}
    redis_passwords = {i: secrets.token_urlsafe(24) for i in IDENTITIES}
    for identity in IDENTITIES:
        d = creds.identity_dir(identity)
        _write_secret(d / "libra_nats_user", identity)
        _write_secret(d / "libra_nats_password", passwords[identity])
        _write_secret(d / "libra_redis_user", identity)
        _write_secret(d / "libra_redis_password", redis_passwords[identity])
        if identity in ("rollout-engine", "trainer", "cli"):
            _write_secret(d / "libra_weight_sync_token", token)
    _write_secret(creds.nats_conf, nats_config(passwords))
    acl = [redis_acl(i, redis_passwords[i]) for i in IDENTITIES]
    _write_secret(creds.redis_conf, "\n".join(["user default off", *acl]) + "\n")


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
