"""Rollout backends, picked by the run config's `rollout.backend`: `backends/<name>.py` defines
`create(job, settings) -> Backend` (`job`: the part of the run config an engine reads), so adding a backend is adding a file."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.runconfig import EngineJob
    from services.generation.backends.base import Backend
    from services.generation.config import EngineSettings


def create_backend(job: EngineJob, settings: EngineSettings) -> Backend:
    """Imports only the chosen backend's module, so torch or vllm load only when needed."""
    name = job.rollout.backend
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{name}":
            raise SystemExit(f"unknown rollout backend {name!r}") from None
        raise
    return module.create(job, settings)
