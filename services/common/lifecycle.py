"""Process lifecycle: parse settings, set up logging and tracing, run until a signal, drain, exit.

A service provides `serve(common, run, stop: asyncio.Event, stack: AsyncExitStack)` for one job; resources
it enters into the stack are closed in reverse order after `stop` is set, within `grace_s`. With
`LIBRA_CONFIG` set the process runs that one job (the container deployments); without it, it waits
for jobs on the control plane and runs them one after another (`libra up`, see control.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import signal
from pathlib import Path
from typing import Any

from services.common.config import CommonSettings, load_settings
from services.common.control import JobAgent, Serve
from services.common.errors import CredentialsRefused
from services.common.logging import configure_logging, get_logger
from services.common.runconfig import load_run_config
from services.common.tasks import cancel_and_wait
from services.common.tracing import configure_tracing, set_trace_file, shutdown_tracing


def run_service(service: str, serve: Serve | str, *, grace_s: float = 10.0) -> int:
    """Runs `serve` (or the `serve` of the module named) until a signal. A module named is imported
    only once the settings, a pinned job's config and the credentials are checked: a service given
    a bad one exits 2 in about a second, not after importing torch (4-46 s on a busy CPU)."""
    common = load_settings(CommonSettings)
    # A pinned job's run config is parsed here, once, before anything starts: one clear error.
    run = load_run_config(common.config) if common.config else None
    common.require_credentials()
    pinned = run is not None
    worker_id = common.resolve_worker_id(service)
    common = common.model_copy(update={"worker_id": worker_id})
    serving: Serve = importlib.import_module(serve).serve if isinstance(serve, str) else serve
    run_id = common.run_id if pinned else None
    configure_logging(
        service, fmt=common.log_format, level=common.log_level, run_id=run_id, worker_id=worker_id
    )
    configure_tracing(
        service,
        run_id=run_id,
        worker_id=worker_id,
        otlp_endpoint=common.otlp_endpoint,
        ca_file=common.tls_ca_file,
    )
    log = get_logger()
    if common.metrics_port is not None:
        from services.common.metrics import serve_metrics

        try:
            port = serve_metrics(common.metrics_addr, common.metrics_port)
            log.info("metrics_serving", url=f"http://{common.metrics_addr}:{port}/metrics")
        except OSError as err:  # the service still runs; only its metrics are missing
            log.error(
                "metrics_not_served", addr=common.metrics_addr, port=common.metrics_port, error=str(err)
            )

    async def jobs() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await JobAgent(service, common, serving, grace_s=grace_s).run(stop)
        log.info("service_stopped")
        return 0

    if pinned and common.trace_dir:
        set_trace_file(Path(common.trace_dir) / common.run_id / f"{worker_id}.jsonl")

    async def main() -> int:
        assert run is not None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with contextlib.AsyncExitStack() as stack:
            task: asyncio.Future[Any] = asyncio.ensure_future(serving(common, run, stop, stack))
            stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            failure = task.exception() if task in done else None
            if failure is not None:
                log.error("service_failed", error=repr(failure))
                stopper.cancel()
                raise failure
            stop.set()
            log.info("service_stopping")
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                log.warning("service_stop_timeout", grace_s=grace_s)
                await cancel_and_wait([task])
            stopper.cancel()
        log.info("service_stopped")
        return 0

    log.info("service_starting", nats_url=common.nats_url, redis_url=common.redis_url, pinned_job=pinned)
    try:
        return asyncio.run(main() if pinned else jobs())
    except CredentialsRefused as err:
        log.error("credentials_refused", error=str(err))
        return 2
    finally:
        shutdown_tracing()
