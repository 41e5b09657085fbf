"""Rollout backends, picked by the run config's `rollout.backend`: `backends/<name>.py` defines
`create(run, settings) -> Backend`, so adding a backend is adding a file."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.runconfig import RunConfig
    from services.generation.backends.base import Backend
    from services.generation.config import EngineSettings


def create_backend(run: RunConfig, settings: EngineSettings) -> Backend:
    """Imports only the chosen backend's module, so torch or vllm load only when needed."""
    name = run.rollout.backend
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{name}":
            raise SystemExit(f"unknown rollout backend {name!r}") from None
        raise
    return module.create(run, settings)
