"""`python -m services.rollout_engine.host`: one process serving many rollout-engine identities.

A cluster of 1,024 engines has 1,024 engine processes, one per GPU set. To run the control plane
at that scale on one machine (`libra bench live --engines-per-host K`), a host process serves K
*emulated* engines: each is the rollout-engine service it would be alone — its own worker id,
credentials (NATS user, Redis ACL user), lease and fencing token, turn and weight-sync subjects,
WeightSync server on a port of its own and control-plane agent — sharing one Python process and
event loop instead of K. The planner, the scheduler and the trainer cannot tell the difference.

What the engines of a host share: the process (killing it kills all of them; its supervisor
restarts them together), its Prometheus exporter (counters add up over its engines) and its
tracer: a job's spans of all of its engines go to one file, named after its first engine
(`<trace_dir>/rollout-engine-<first>.jsonl`; `libra trace` reads every file of the job). A host holds the secrets of all of its identities, so a
compromised host speaks for its K engines, never for another kind or another host's engines.

Configured like the engine service (`LIBRA_ROLLOUT_ENGINE_*`, shared by the host's engines) plus:

- `LIBRA_ENGINE_HOST_WORKERS`: the worker ids it serves, comma-separated;
- `LIBRA_ENGINE_HOST_SECRETS_ROOT`: the stack's credentials directory, in which each worker's
  identity has its own (`<root>/<worker_id>/`, as `libra credentials` writes them); unset with
  `--insecure` only;
- `LIBRA_ENGINE_HOST_NAME`: its name in its log lines (`libra bench live` names them
  `engine-host-<n>`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import structlog
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.cli import describe
from services.common.config import ID_PATTERN, CommonSettings, ConfigFileError, load_settings
from services.common.errors import CredentialsRefused
from services.common.logging import configure_logging, get_logger
from services.common.tracing import configure_tracing, shutdown_tracing
from services.generation.config import EngineSettings

SERVICE = "rollout-engine"


class EngineHostSettings(BaseSettings):
    """The identities an engine host serves; read from LIBRA_ENGINE_HOST_* variables."""

    model_config = SettingsConfigDict(
        env_prefix="LIBRA_ENGINE_HOST_", extra="ignore", use_attribute_docstrings=True
    )

    workers: str = Field(min_length=1)
    """Worker ids of the engines this host serves, comma-separated (rollout-engine-<n>, ...)."""
    secrets_root: str | None = None
    """Directory holding one credentials directory per worker id (`<root>/<worker_id>/`)."""
    name: str = Field("", pattern=r"^[A-Za-z0-9_-]{0,64}$")
    """The host's name in its log lines (a stack names its hosts `engine-host-<n>`); empty:
    `engine-host-<first worker's number>`."""

    @field_validator("workers")
    @classmethod
    def _worker_ids(cls, v: str) -> str:
        ids = [w.strip() for w in v.split(",")]
        bad = [w for w in ids if not _is_engine_id(w)]
        if bad:
            raise ValueError(
                f"not rollout-engine worker ids: {bad} (expected {SERVICE}-<name>, comma-separated)"
            )
        if len(set(ids)) != len(ids):
            raise ValueError("a worker id is named twice")
        return ",".join(ids)

    def worker_ids(self) -> list[str]:
        return self.workers.split(",")


def _is_engine_id(worker_id: str) -> bool:
    return bool(re.fullmatch(ID_PATTERN, worker_id)) and worker_id.startswith(SERVICE + "-")


def identities(host: EngineHostSettings) -> list[CommonSettings]:
    """Each served worker's settings: the process's `LIBRA_*` ones, with the worker's own id and
    credentials. A missing credentials directory, or credentials of another worker, exit 2."""
    out = []
    for worker_id in host.worker_ids():
        overrides: dict[str, object] = {"worker_id": worker_id}
        if host.secrets_root:
            secrets = Path(host.secrets_root) / worker_id
            if not secrets.is_dir():
                raise ConfigFileError(
                    f"LIBRA_ENGINE_HOST_SECRETS_ROOT={host.secrets_root} has no credentials of {worker_id} "
                    f"({secrets} is not a directory)"
                )
            overrides["_secrets_dir"] = str(secrets)
        common = load_settings(CommonSettings, **overrides)
        common.require_credentials()
        common.resolve_worker_id(SERVICE)
        out.append(common)
    return out


async def serve_all(commons: list[CommonSettings], stop: asyncio.Event) -> None:
    """Each identity's control-plane agent, in a task of its own (its log lines carry its worker
    id), until `stop`; the first agent to fail stops the others."""
    from services.common.control import JobAgent
    from services.rollout_engine.service import serve

    async def one(common: CommonSettings, first: bool) -> None:
        structlog.contextvars.bind_contextvars(worker_id=common.worker_id)
        await JobAgent(SERVICE, common, serve, trace_files=first).run(stop)

    # the process has one trace file: the first engine's agent opens it for each job (all of the
    # host's engines' spans go there) and closes it when that engine's job ends
    tasks = [asyncio.ensure_future(one(c, i == 0)) for i, c in enumerate(commons)]
    try:
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print("usage: python -m services.rollout_engine.host [--insecure]\n")
        print("Serves many emulated rollout engines in one process. Configured through the environment:\n")
        print(describe(EngineHostSettings))
        print(describe(CommonSettings))
        print(describe(EngineSettings))
        return 0
    if [a for a in args if a != "--insecure"]:
        print("unexpected arguments; configure through LIBRA_* variables (see --help)", file=sys.stderr)
        return 2
    if "--insecure" in args:
        os.environ["LIBRA_INSECURE"] = "1"
    host = load_settings(EngineHostSettings)
    base = load_settings(CommonSettings)
    if base.config:
        raise ConfigFileError(
            "an engine host runs the jobs of the control plane (`libra up`, `libra run`); a pinned "
            "deployment (LIBRA_CONFIG) runs one engine per process: python -m services.rollout_engine"
        )
    engine = load_settings(EngineSettings)
    if engine.grpc_port and len(host.worker_ids()) > 1:
        raise ConfigFileError(
            f"LIBRA_ROLLOUT_ENGINE_GRPC_PORT={engine.grpc_port}: the engines of a host each bind a "
            "WeightSync port of their own; leave it 0 (any free port)"
        )
    commons = identities(host)
    from services.rollout_engine.weight_sync import limit_malloc_arenas

    limit_malloc_arenas()
    host_id = host.name or f"engine-host-{host.worker_ids()[0].removeprefix(SERVICE + '-')}"
    configure_logging(SERVICE, fmt=base.log_format, level=base.log_level, host=host_id)
    configure_tracing(
        SERVICE, run_id=None, worker_id=host_id, otlp_endpoint=base.otlp_endpoint, ca_file=base.tls_ca_file
    )
    log = get_logger()
    if base.metrics_port is not None:
        from services.common.metrics import serve_metrics

        try:
            port = serve_metrics(base.metrics_addr, base.metrics_port)
            log.info("metrics_serving", url=f"http://{base.metrics_addr}:{port}/metrics")
        except OSError as err:
            log.error("metrics_not_served", port=base.metrics_port, error=str(err))

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_all(commons, stop)
        log.info("engine_host_stopped", engines=len(commons))
        return 0

    log.info("engine_host_starting", engines=len(commons), workers=host.worker_ids(), nats_url=base.nats_url)
    try:
        return asyncio.run(run())
    except CredentialsRefused as err:
        log.error("credentials_refused", error=str(err))
        return 2
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
