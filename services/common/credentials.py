"""Per-stack credentials and who may do what.

`generate` writes one directory per identity (each worker of the stack, or each service kind where
workers cannot be named ahead, and `cli` for the operator's `libra run`), holding only that
identity's secrets as files named after the settings they fill (`libra_nats_password`, ...), so
`LIBRA_SECRETS_DIR=<dir>/<identity>` is all a process needs — the same layout a Kubernetes Secret
or a compose secret mounts. Beside them, `nats/nats.conf` holds the NATS users, each allowed only
what its role needs (docs/security.md has the table): the subjects it owns to publish (only the
planner plans, only the scheduler completed trajectories, only the trainer weight updates), the
subjects on which a worker speaks for itself for its own worker id only (hello, heartbeat, load,
turn results: subjects.SPOKEN), the events it consumes to subscribe, its own durable consumer to
pull, the last-value subjects it reads, its own reply inbox, and replies only to requests it
received; the JetStream API that makes streams and consumers only for the operator's `cli`.
`redis/redis.conf` holds a Redis ACL user per identity, allowed its role's commands and no key
until `libra run` grants it exactly the keys it owns in the job's run (services/common/redis_scope.py),
the operator's ACL user that grants them, no default user, and the healthcheck's user, allowed
only PING. `nats/server.conf`
is what a container runs: `nats.conf` and the monitoring endpoint on its loopback (healthcheck).
Nothing here ever prints a secret.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common import subjects
from services.common.streams import SCHEDULER_FEED, TRAINER_FEED
from services.common.weight_signing import new_signing_key, public_key, trainers_json

SERVICES = ("planner", "scheduler", "rollout-engine", "trainer", "tool-sandbox")
IDENTITIES = (*SERVICES, "cli")
"""The identities of a stack whose workers share one per kind (Kubernetes, where pod names are not
known ahead): `generate(root)`. `generate(root, workers)` gives every worker its own instead."""
HEALTH_USER = "health"
"""Redis's healthcheck user: PING and nothing else, no password; like every client it still needs a
certificate of the stack's CA (`redis/health-cert.pem`, client-only, in the server's own directory)."""
NATS_MONITOR = "127.0.0.1:8222"
"""Where nats-server serves its monitoring endpoints in a container (`nats/server.conf`): its loopback
only, for the healthcheck (the endpoints have no authentication; nothing outside reaches them)."""
NATS_MAX_PAYLOAD = 8 << 20
"""Largest NATS message the stack accepts (a 64k-token trajectory with logprobs is about 0.6 MB)."""

_RUN = "libra.v1.*"
_CTL = "libra.ctl.v1"
_JS = "$JS.API"
CTL_SPOKEN = (f"{_CTL}.heartbeat", f"{_CTL}.ack")
"""Where a worker tells the operator its status and its answer to a job command, as on a run's
spoken subjects (subjects.SPOKEN): `<subject>.<kind>.<worker_id>`."""


TRAINER_ENGINE_SUFFIX = "-engine"
"""The trainer's own engine (planner.lending.trainer_serves) is the worker `<trainer's id>-engine`."""
TRAINER_ENGINE_SPEAKS = (
    subjects.TURN_RESULT,
    subjects.TURN_PROGRESS,
    subjects.ENGINE_LOAD,
    subjects.HYBRID_STATE,
    subjects.WORKER_HELLO,
    subjects.METRICS,
)
"""What the trainer's own engine says about itself: an engine's results, load, role-change steps
(parked, with the turns it handed back), hello and metrics."""


def trainer_engine_id(trainer_id: str) -> str:
    return trainer_id + TRAINER_ENGINE_SUFFIX


def kind_of(identity: str) -> str:
    """The service kind of an identity or worker id (rollout-engine-3 → rollout-engine)."""
    for kind in IDENTITIES:
        if identity == kind or identity.startswith(kind + "-"):
            return kind
    raise ValueError(f"{identity!r} names no service kind (one of {', '.join(IDENTITIES)}, or <kind>-<n>)")


@dataclass(frozen=True)
class Grants:
    """What one kind may do on NATS; run-scoped subjects are suffixes of `libra.v1.<run>.`."""

    publishes: tuple[str, ...] = ()
    speaks: tuple[str, ...] = ()
    """Spoken subjects (subjects.SPOKEN) it publishes on, for its own worker id only."""
    subscribes: tuple[str, ...] = ()
    """Spoken ones among them are subscribed for every speaker."""
    pulls: tuple[str, ...] = ()
    """Durable consumers (services/common/streams.py) it may fetch from and acknowledge."""
    reads: tuple[str, ...] = (subjects.PLAN,)
    """Last-value subjects it may read from their streams (a direct get by subject)."""


_GRANTS: dict[str, Grants] = {
    "planner": Grants(
        # alive.*: whether a role holder's process is there (NATS: does anyone subscribe)
        publishes=(subjects.PLAN, subjects.ROLE_CHANGE, subjects.FACTS_PLANNER, f"{subjects.ALIVE}.>"),
        subscribes=(
            subjects.WORKER_HELLO,
            subjects.WORKLOAD_STATS,
            subjects.TRAIN_METRICS,
            subjects.ROLE_REQUEST,
            subjects.LEND_REQUEST,
            subjects.HYBRID_STATE,
        ),
    ),
    "scheduler": Grants(
        publishes=(
            f"{subjects.TURN_REQUEST}.*",
            subjects.TOOL_CALL,
            subjects.AGENT_RUN,
            subjects.AGENT_CANCEL,
            subjects.TRAJ_COMPLETED,
            subjects.TRAJ_SAMPLE,
            subjects.WORKLOAD_STATS,
            subjects.FACTS_SCHEDULER,
        ),
        subscribes=(
            subjects.PLAN,
            subjects.TURN_RESULT,
            subjects.TURN_PROGRESS,
            subjects.TOOL_RETURN,
            subjects.AGENT_ACCEPTED,
            subjects.AGENT_RETURN,
            subjects.ENGINE_LOAD,
            subjects.WEIGHTS_UPDATED,
            subjects.SCHEDULER_STATS,
        ),
        pulls=(SCHEDULER_FEED.durable,),
        reads=(subjects.PLAN, subjects.FACTS_TRAINER),
    ),
    "rollout-engine": Grants(
        speaks=(subjects.TURN_RESULT, subjects.TURN_PROGRESS, subjects.ENGINE_LOAD, subjects.HYBRID_STATE),
        subscribes=(subjects.PLAN, subjects.HYBRID_GROUP),  # and its own turn requests
    ),
    "tool-sandbox": Grants(
        publishes=(subjects.TOOL_RETURN,),
        speaks=(subjects.AGENT_ACCEPTED, subjects.AGENT_RETURN),  # about the agent runs it took
        subscribes=(subjects.PLAN, subjects.TOOL_CALL, subjects.AGENT_RUN, subjects.AGENT_CANCEL),
    ),
    "trainer": Grants(
        publishes=(
            subjects.WEIGHTS_UPDATED,
            subjects.TRAIN_METRICS,
            subjects.GROUP_OUTCOME,
            subjects.HYBRID_GROUP,
            subjects.FACTS_TRAINER,
            subjects.LEND_REQUEST,  # request/reply: the planner answers on this trainer's inbox
        ),
        speaks=(subjects.HYBRID_STATE,),  # a refused join, about the worker it refuses (bus.py)
        subscribes=(subjects.PLAN, subjects.HYBRID_STATE),
        pulls=(TRAINER_FEED.durable,),
    ),
    "cli": Grants(
        publishes=(subjects.SCHEDULER_STATS, subjects.ROLE_REQUEST),
        subscribes=(">",),  # the operator watches its jobs: every run subject
        reads=(">",),
    ),
}
_SPOKEN_BY_ALL = (subjects.WORKER_HELLO, subjects.METRICS, subjects.ERRORS)
_CLI_JS = (  # the control identity: a run's streams and consumers, made, read and deleted
    f"{_JS}.INFO",
    f"{_JS}.STREAM.CREATE.*",
    f"{_JS}.STREAM.UPDATE.*",
    f"{_JS}.STREAM.INFO.*",
    f"{_JS}.STREAM.DELETE.*",
    f"{_JS}.CONSUMER.CREATE.*.>",
    f"{_JS}.CONSUMER.INFO.*.*",
)


@dataclass(frozen=True)
class Identity:
    """A NATS and Redis user: one worker's own (`per_worker`), or shared by every worker of a kind."""

    name: str
    per_worker: bool = False

    @property
    def kind(self) -> str:
        return kind_of(self.name)

    @property
    def speaks_as(self) -> str:
        """The worker-id token of the subjects it speaks on: its own id, or any of its kind's."""
        return self.name if self.per_worker else "*"

    def speaking(self, base: str) -> str:
        return f"{base}.{self.kind}.{self.speaks_as}"


_REDIS_COMMANDS = " ".join(
    (
        "-@all +@read +@write +@transaction -@dangerous",
        # no scripting (a script can hold the server: services/common/ownership.py uses
        # WATCH/MULTI), no listing of keys, no other database
        "-@scripting -scan -randomkey -dbsize -select -move -copy",
        # connecting, and nothing else of CLIENT (no TRACKING, no KILL, no LIST)
        "+auth +hello +ping +echo +reset +client|setinfo +client|setname +client|getname +client|id",
    )
)
"""What a service identity may run: reads and writes of its own keys and transactions."""
REDIS_MAXMEMORY = "1gb"
"""Redis's memory cap (`redis/redis.conf`): far above what a job keeps (leases, a commit record,
the trained ids, the ledger), so an identity that floods its own keys fills Redis only this far."""
REDIS_MAX_VALUE = "1mb"
REDIS_MAX_VALUE_BYTES = 1 << 20
"""`REDIS_MAX_VALUE` in bytes: a longer value is a protocol error, and Redis drops the connection."""
REDIS_SERVER_LINES = (
    f"maxmemory {REDIS_MAXMEMORY}",
    # never evict: a lease, a fencing counter or a commit record must not vanish under memory
    # pressure; writes that need memory fail (typed errors) while renewals and reads go on
    "maxmemory-policy noeviction",
    # one value (any bulk argument) is at most 1 MB, Redis's smallest bound: Libra's largest, a
    # plan of a 1,024-engine stack, is ~100 kB; an identity cannot park 64 MB under its own key
    f"proto-max-bulk-len {REDIS_MAX_VALUE}",
)
REDIS_ADMIN_USER = "libra-acl"
"""The operator's Redis user for granting a job's keys (services/common/redis_scope.py): it may
change ACL users and read the ACL log, and touches no key. Its password is in the cli directory
(`libra_redis_admin_password`), mounted by no service."""
REDIS_ADMIN_FILE = "libra_redis_admin_password"
_REDIS_ADMIN_COMMANDS = (
    "-@all +acl|setuser +acl|users +acl|dryrun +acl|log "
    "+auth +hello +ping +client|setinfo +client|setname +client|getname +client|id"
)


def redis_acl(identity: Identity, password: str) -> str:
    """The Redis ACL line of `identity` (redis.conf `user` directive): the commands of its role and,
    for a service, no key at all until `libra run` grants it exactly the keys its role owns in the
    job's run (redis_scope.grant_run): a pattern written here would have to span the run segment
    (`libra:*:…`), and an identity could create keys under any run name without bound. The
    operator's `cli` reads every run's keys."""
    keys = ["%R~libra:*"] if identity.kind == "cli" else []
    return " ".join(("user", identity.name, "on", f">{password}", "resetchannels", *keys, _REDIS_COMMANDS))


def redis_admin_acl(password: str) -> str:
    return " ".join(("user", REDIS_ADMIN_USER, "on", f">{password}", "resetchannels", _REDIS_ADMIN_COMMANDS))


REDIS_HEALTH_ACL = f"user {HEALTH_USER} on nopass resetchannels -@all +ping"
"""The healthcheck's Redis user: no key, no channel, one command."""
NATS_SERVER_CONF = f"""# nats-server in a container: the users of nats.conf, and the monitoring endpoints on the
# container's loopback only, for its healthcheck (they have no authentication)
include nats.conf
http: {NATS_MONITOR}
"""


def inbox_prefix(identity: str) -> str:
    """Where `identity`'s replies come (JetStream's included): only it may subscribe there."""
    return f"_INBOX_{identity}"


def publish_allowed(identity: Identity) -> list[str]:
    """The subjects `identity` may publish to. Replies to requests it received are allowed by
    `allow_responses` (nats_config), to those requests' reply subjects only; no other inbox."""
    kind = identity.kind
    g = _GRANTS[kind]
    speaks = [*g.speaks, *_SPOKEN_BY_ALL] if kind != "cli" else []
    out = [f"{_RUN}.{s}" for s in g.publishes]
    out += [f"{_RUN}.{identity.speaking(s)}" for s in speaks]
    if kind == "trainer" and identity.per_worker:  # its own engine (a kind's identity speaks as any)
        engine = trainer_engine_id(identity.name)
        out += [f"{_RUN}.{subjects.spoken(s, kind, engine)}" for s in TRAINER_ENGINE_SPEAKS]
    for durable in g.pulls:
        out += [
            f"{_JS}.CONSUMER.INFO.*.{durable}",
            f"{_JS}.CONSUMER.MSG.NEXT.*.{durable}",
            f"$JS.ACK.*.{durable}.>",
        ]
    out += [f"{_JS}.DIRECT.GET.*.{_RUN}.{s}" for s in g.reads]
    # a service waits for the streams it uses (their configuration and counts, never their messages)
    out += [*_CLI_JS] if kind == "cli" else [f"{_JS}.STREAM.INFO.*"]
    # the control plane: the operator starts, stops and polls jobs; services report heartbeats and acks
    if kind == "cli":
        out += [f"{_CTL}.job.start", f"{_CTL}.job.stop", f"{_CTL}.status"]
    else:
        out += [identity.speaking(s) for s in CTL_SPOKEN]
    return out


def subscribe_allowed(identity: Identity) -> list[str]:
    """The subjects `identity` may subscribe to: the events its role consumes (every speaker's, on
    a spoken subject), its own turn requests (an engine), its own inbox, and the control plane's
    (services: job start, stop and status; the operator: heartbeats and acks)."""
    kind = identity.kind
    run = [f"{s}.>" if s in subjects.SPOKEN else s for s in _GRANTS[kind].subscribes]
    if kind == "rollout-engine":
        run.append(f"{subjects.TURN_REQUEST}.{identity.speaks_as}")
    elif kind == "trainer":  # its own engine's turns (planner.lending.trainer_serves)
        own = trainer_engine_id(identity.name) if identity.per_worker else "*"
        run.append(f"{subjects.TURN_REQUEST}.{own}")
    if kind in ALIVE_KINDS:  # the planner's probes of it: subscribed, never answered
        run.append(identity.speaking(subjects.ALIVE))
    ctl = (
        [f"{s}.>" for s in CTL_SPOKEN]
        if kind == "cli"
        else [f"{_CTL}.job.start", f"{_CTL}.job.stop", f"{_CTL}.status"]
    )
    return [*(f"{_RUN}.{s}" for s in run), *ctl, f"{inbox_prefix(identity.name)}.>"]


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
    def nats_server_conf(self) -> Path:
        """nats-server's configuration in a container: `nats.conf` and the loopback monitor."""
        return self.root / "nats" / "server.conf"

    @property
    def redis_conf(self) -> Path:
        return self.root / "redis" / "redis.conf"

    @property
    def layout_file(self) -> Path:
        return self.root / "identities.json"

    def identities(self) -> list[Identity]:
        """The stack's identities (the operator's `cli` last); none before `generate`."""
        try:
            layout = json.loads(self.layout_file.read_text())
        except FileNotFoundError:
            return []
        return [Identity(name, bool(layout["per_worker"]) and name != "cli") for name in layout["identities"]]

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

    def redis_admin_auth(self) -> dict[str, str] | None:
        """redis-py's `username` and `password` of the operator's ACL user (REDIS_ADMIN_USER);
        None where the cli directory has none (credentials written before it existed)."""
        path = self.identity_dir("cli") / REDIS_ADMIN_FILE
        if not path.exists():
            return None
        return {"username": REDIS_ADMIN_USER, "password": path.read_text().strip()}


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)


ALIVE_KINDS = ("scheduler", "trainer")
"""The kinds whose role one worker holds at a time: each subscribes to its own
`alive.<kind>.<worker_id>` while its process is there (services/common/membership.py), so the
planner's probe finds nobody once it is gone. They need not answer (and the trainer may not)."""
RESPONDERS = ("planner", "scheduler")
"""The kinds that answer requests: the planner (role and lend requests), the scheduler (stats)."""


def nats_config(passwords: dict[Identity, str]) -> str:
    """nats-server configuration: one user per identity with its publish and subscribe permissions."""
    users = []
    for identity, password in passwords.items():
        perms: dict[str, object] = {
            "publish": {"allow": publish_allowed(identity)},
            "subscribe": {"allow": subscribe_allowed(identity)},
        }
        if identity.kind in RESPONDERS:
            # a reply to a request this user received, once, within a minute; never another inbox.
            # (nats-server refuses such a reply when one connection holds two subscriptions that
            # match the request: every responder here subscribes to a request subject once.)
            # Only for the kinds that answer requests: a JetStream publish fanned out to
            # subscribers carries its publisher's ack inbox as the reply, which any subscriber
            # allowed responses could answer with a forged ack.
            perms["allow_responses"] = {"max": 1, "expires": "1m"}
        users.append({"user": identity.name, "password": password, "permissions": perms})
    # JSON is valid nats-server configuration syntax
    body = json.dumps({"users": users}, indent=2)
    return f"max_payload: {NATS_MAX_PAYLOAD}\nauthorization: {body}\n"


def generate(
    root: Path,
    workers: Sequence[str] | None = None,
    owner_uid: int | None = None,
    tls_namespace: str | None = None,
) -> StackCredentials:
    """Writes the credentials of a stack under `root` (mode 0700): one identity per worker in
    `workers` (each speaks only for itself), or, without them, one per service kind (workers of a
    kind share it: Kubernetes, where pod names are not known ahead). Secrets already there are
    kept, so a restarted stack keeps talking to the Redis data and NATS streams it wrote before;
    identities no longer named are removed. With `owner_uid` (run as root, e.g. compose's one-shot
    `credentials` service) the identities' directories are handed to the uid the service images
    run as; nats and redis stay root's. With `tls_namespace`, the stack's own CA issues a
    certificate to every identity and to NATS and Redis, for compose's service names and the
    Kubernetes Services of that namespace (`write_tls`)."""
    names = [*(workers if workers is not None else SERVICES), "cli"]
    for name in names:
        if not _ID_RE.match(name):
            raise ValueError(f"identity {name!r}: letters, digits, '-' and '_' only (at most 64)")
        kind_of(name)  # names a kind
    if len(set(names)) != len(names):
        raise ValueError(f"identities named twice: {names}")
    creds = StackCredentials(root)
    wanted = [Identity(n, workers is not None and n != "cli") for n in names]
    complete = creds.nats_server_conf.exists() and all(
        (creds.identity_dir(i.name) / f).exists() for i in wanted for f in _files(i)
    )
    if not complete or creds.identities() != wanted:
        _write_all(creds, wanted)
    if tls_namespace is not None:
        write_tls(creds, wanted, tls_namespace)
    if owner_uid is not None:
        for identity in wanted:
            d = creds.identity_dir(identity.name)
            for path in (d, *d.iterdir()):
                os.chown(path, owner_uid, owner_uid)
        os.chmod(root, 0o711)  # the services reach their own directory and list nothing
    return creds


_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WEIGHT_SYNC_KINDS = ("rollout-engine", "trainer", "cli")
SIGNING_KEY = "libra_weight_sync_signing_key"
"""A trainer identity's private key: it signs every weight push (services/common/weight_signing.py)."""
TRAINER_KEYS = "libra_weight_sync_trainers"
"""An engine's map of the trainer identities' public keys: it takes only pushes they signed."""


def _files(identity: Identity) -> tuple[str, ...]:
    extra = {"trainer": (SIGNING_KEY,), "rollout-engine": (TRAINER_KEYS,), "cli": (REDIS_ADMIN_FILE,)}.get(
        identity.kind, ()
    )
    return ("libra_nats_password", "libra_redis_user", *extra)


def _write_all(creds: StackCredentials, identities: list[Identity]) -> None:
    creds.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(creds.root, 0o700)

    def kept(identity: str, name: str) -> str:
        path = creds.identity_dir(identity) / name
        return path.read_text().strip() if path.exists() else secrets.token_urlsafe(24)

    def kept_key(identity: str) -> str:
        path = creds.identity_dir(identity) / SIGNING_KEY
        return path.read_text().strip() if path.exists() else new_signing_key()

    token = next(
        (kept(i.name, "libra_weight_sync_token") for i in creds.identities() if i.kind in _WEIGHT_SYNC_KINDS),
        secrets.token_urlsafe(32),
    )
    for old in creds.identities():
        if old not in identities:
            shutil.rmtree(creds.identity_dir(old.name), ignore_errors=True)
    passwords = {i: kept(i.name, "libra_nats_password") for i in identities}
    signing = {i.name: kept_key(i.name) for i in identities if i.kind == "trainer"}
    trainer_keys = trainers_json({name: public_key(key) for name, key in signing.items()})
    redis_passwords = {i: kept(i.name, "libra_redis_password") for i in identities}
    for identity in identities:
        d = creds.identity_dir(identity.name)
        _write_secret(d / "libra_nats_user", identity.name)
        _write_secret(d / "libra_nats_password", passwords[identity])
        _write_secret(d / "libra_redis_user", identity.name)
        _write_secret(d / "libra_redis_password", redis_passwords[identity])
        if identity.per_worker:  # the worker it speaks for (CommonSettings.identity_worker)
            _write_secret(d / "libra_identity_worker", identity.name)
        else:
            (d / "libra_identity_worker").unlink(missing_ok=True)
        if identity.kind in _WEIGHT_SYNC_KINDS:
            _write_secret(d / "libra_weight_sync_token", token)
        if identity.name in signing:
            _write_secret(d / SIGNING_KEY, signing[identity.name])
        if identity.kind == "rollout-engine":
            _write_secret(d / TRAINER_KEYS, trainer_keys)
    _write_secret(creds.nats_conf, nats_config(passwords))
    _write_secret(creds.nats_server_conf, NATS_SERVER_CONF)
    admin_password = kept("cli", REDIS_ADMIN_FILE)
    _write_secret(creds.identity_dir("cli") / REDIS_ADMIN_FILE, admin_password)
    acl = [redis_acl(i, redis_passwords[i]) for i in identities]
    lines = ["user default off", *acl, redis_admin_acl(admin_password), REDIS_HEALTH_ACL, *REDIS_SERVER_LINES]
    _write_secret(creds.redis_conf, "\n".join(lines) + "\n")
    layout = {"per_worker": any(i.per_worker for i in identities), "identities": [i.name for i in identities]}
    _write_secret(creds.layout_file, json.dumps(layout))


def server_hosts(server: str, namespace: str) -> list[str]:
    """The names a stack's server answers to: compose's service name, the Kubernetes Service's."""
    return [
        server,
        f"{server}.{namespace}.svc",
        f"{server}.{namespace}.svc.cluster.local",
        "localhost",
        "127.0.0.1",
    ]


def identity_hosts(identity: Identity, namespace: str) -> list[str]:
    """The names an identity's certificate is good for: its worker id (compose's hostname), and a
    pod of its kind behind the kind's headless Service (an engine serves WeightSync with it)."""
    kind = identity.kind
    pods = [f"*.{kind}", f"*.{kind}.{namespace}.svc", f"*.{kind}.{namespace}.svc.cluster.local"]
    return [*dict.fromkeys([identity.name, kind]), *pods, "localhost", "127.0.0.1"]


def write_tls(creds: StackCredentials, identities: list[Identity], namespace: str) -> None:
    """The stack's CA (kept in `tls/`, never mounted by a service), `ca.pem`, `cert.pem` and
    `key.pem` in each identity's directory, and NATS's and Redis's server certificates
    (`server-cert.pem`, `server-key.pem`, `ca.pem` in `nats/` and `redis/`). What is there stays."""
    from services.common.pki import Authority

    ca = Authority.load(creds.root / "tls")
    if ca is None:
        ca = Authority.create("libra-stack-ca")
        ca.save(creds.root / "tls")
    for server in ("nats", "redis"):
        d = creds.root / server
        if not (d / "server-cert.pem").exists():
            ca.issue(d, server, server_hosts(server, namespace), client=False, stem="server-")
    if not (creds.root / "redis" / "health-cert.pem").exists():  # the healthcheck's client certificate
        ca.issue(creds.root / "redis", HEALTH_USER, [HEALTH_USER], server=False, stem="health-")
    for identity in identities:
        d = creds.identity_dir(identity.name)
        if not (d / "cert.pem").exists():
            hosts = ["cli"] if identity.kind == "cli" else identity_hosts(identity, namespace)
            ca.issue(d, identity.name, hosts, server=identity.kind != "cli")


def k8s_secrets(creds: StackCredentials, namespace: str) -> list[dict[str, object]]:
    """Kubernetes Secrets holding `creds`, as deploy/k8s mounts them: `libra-<identity>-credentials`
    per service (files named like the settings), `libra-nats-config` and `libra-redis-config`."""

    def secret(name: str, files: dict[str, str]) -> dict[str, object]:
        meta = {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "libra"}}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "stringData": files}

    out = [
        secret(
            f"libra-{server}-config", {f.name: f.read_text() for f in sorted((creds.root / server).iterdir())}
        )
        for server in ("nats", "redis")
    ]
    for identity in creds.identities():
        files = {f.name: f.read_text() for f in sorted(creds.identity_dir(identity.name).iterdir())}
        out.append(secret(f"libra-{identity.name}-credentials", files))
    return out
