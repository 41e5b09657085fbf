"""Planner settings (env prefix LIBRA_PLANNER_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class PlannerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LIBRA_PLANNER_", extra="ignore", use_attribute_docstrings=True
    )

    tick_s: float = Field(1.0, gt=0)
    """How often leases are checked and a changed plan is published."""
