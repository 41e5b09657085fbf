"""A job's Redis keys: granted to each service identity at the job's start, exactly those it owns.

The stack's Redis ACL (credentials.redis_acl) gives a service user the commands of its role and no
key: a pattern written when the stack is made would have to span the run segment
(`libra:*:lease:worker:<id>`), and an identity could then create keys under any run name without
bound. `libra run` knows the run: before it starts a job (as it creates the run's NATS streams) it
grants every service user exactly the keys of that run its role writes (`ACL SETUSER <user>
resetkeys …`, as the operator's ACL user `credentials.REDIS_ADMIN_USER`), and read access to the
run's leases. Where the stack has an identity per worker the keys are named one by one, so what an
identity may write is a fixed set of keys, each at most `credentials.REDIS_MAX_VALUE`: its key
count and its memory are bounded. A kind's shared identity (Kubernetes: pod names are not known
ahead) writes its workers' leases as `lease:worker:<kind>*`, bounded by Redis's `maxmemory` only.

Granting a run takes the previous run's keys away (one job at a time on a stack). Redis keeps ACL
changes in memory only: `RunKeys.ensure` notices a Redis that restarted without them and grants
them again; `RunKeys.refused` reads the ACL log of what the job's identities were refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.credentials import (
    HEALTH_USER,
    REDIS_ADMIN_USER,
    SERVICES,
    Identity,
    kind_of,
    trainer_engine_id,
)
from services.common.membership import PLANNER_ROLE, SCHEDULER_ROLE, TRAINER_ROLE
from services.common.ownership import (
    LEDGER_KEYS,
    committed_key,
    ledger_key,
    plans_key,
    role_changes_key,
    trained_key,
)


def service_users(names: Sequence[str]) -> list[Identity]:
    """The service identities among Redis's users (not the operator's, the admin or the health
    user). A stack has an identity per worker when any of them names a worker (`rollout-engine-0`)
    rather than a kind (`rollout-engine`); then every one of them is a worker's own."""
    kinds = {}
    for name in names:
        if name in (HEALTH_USER, REDIS_ADMIN_USER, "default"):
            continue
        try:
            kind = kind_of(name)
        except ValueError:
            continue
        if kind in SERVICES:
            kinds[name] = kind
    per_worker = any(name != kind for name, kind in kinds.items())
    return [Identity(name, per_worker) for name in sorted(kinds)]


def _workers(identity: Identity) -> list[str]:
    """The worker ids `identity` speaks for: its own (a trainer's engine too), or its kind's."""
    if not identity.per_worker:
        return [f"{identity.kind}*"]
    if identity.kind == "trainer":
        return [identity.name, trainer_engine_id(identity.name)]
    return [identity.name]


def run_key_patterns(identity: Identity, run_id: str, users: Sequence[Identity]) -> list[str]:
    """The ACL key patterns of `identity` in run `run_id` (`~` read and write, `%R~` read):
    every worker's own lease; the planner every worker's and role lease, their fencing counters
    and the plan history; the trainer its role lease, commit record and trained set; the
    scheduler its role lease and ledger; every service reads the run's leases."""
    run = f"libra:{run_id}"
    own = [f"~{run}:lease:worker:{w}" for w in _workers(identity)]
    reads = [f"%R~{run}:lease:*"]
    kind = identity.kind
    if kind == "planner":
        workers = [w for u in users for w in _workers(u)]
        resources = [*(f"worker:{w}" for w in workers), TRAINER_ROLE, SCHEDULER_ROLE, PLANNER_ROLE]
        leases = [f"~{run}:{space}:{r}" for space in ("lease", "fence") for r in resources]
        return [*dict.fromkeys(leases), f"~{plans_key(run_id)}", f"~{role_changes_key(run_id)}", *reads]
    if kind == "trainer":
        owned = [f"~{committed_key(run_id)}", f"~{trained_key(run_id)}", f"~{run}:lease:{TRAINER_ROLE}"]
        return [*owned, *own, *reads]
    if kind == "scheduler":
        ledger = [f"~{ledger_key(run_id, k)}" for k in LEDGER_KEYS]
        return [*ledger, f"~{run}:lease:{SCHEDULER_ROLE}", *own, *reads]
    return [*own, *reads]


def _probe(run_id: str) -> tuple[str, ...]:
    """A write the planner may make in `run_id` only once the run is granted."""
    return ("RPUSH", plans_key(run_id), "x")


class RunKeys:
    """The operator's grant of one run's keys, through its ACL user's connection `admin`."""

    def __init__(self, admin: Any, run_id: str):
        self.r = admin
        self.run_id = run_id
        self.users: list[Identity] = []

    async def grant(self) -> list[Identity]:
        """Grants every service user its keys in the run (and takes every other run's away), and
        clears the ACL log so that what it holds afterwards is this job's."""
        names = [
            n.decode() if isinstance(n, bytes) else str(n)
            for n in await self.r.execute_command("ACL", "USERS")
        ]
        self.users = service_users(names)
        for u in self.users:
            patterns = run_key_patterns(u, self.run_id, self.users)
            await self.r.execute_command("ACL", "SETUSER", u.name, "resetkeys", *patterns)
        await self.r.execute_command("ACL", "LOG", "RESET")
        return self.users

    async def granted(self) -> bool:
        """Whether Redis still holds the grant (a restarted Redis has only its configuration's)."""
        planner = next((u.name for u in self.users if u.kind == "planner"), None)
        if planner is None:
            return True
        answer = await self.r.execute_command("ACL", "DRYRUN", planner, *_probe(self.run_id))
        return (answer.decode() if isinstance(answer, bytes) else str(answer)) == "OK"

    async def ensure(self) -> bool:
        """Grants the run again where Redis lost it; True when it did."""
        if await self.granted():
            return False
        await self.grant()
        return True

    async def refused(self) -> dict[str, dict[str, int]]:
        """What Redis refused the stack's users since the grant, by user and reason (`command`,
        `key`, `channel`, `auth`): its ACL log, which keeps the last 128 distinct refusals, each
        with its count."""
        out: dict[str, dict[str, int]] = {}
        for entry in await self.r.acl_log():
            user, reason = str(entry.get("username")), str(entry.get("reason"))
            by = out.setdefault(user, {})
            by[reason] = by.get(reason, 0) + int(entry.get("count", 1))
        return out
