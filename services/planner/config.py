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
    gone_s: float = Field(3.0, ge=0)
    """How long a trainer or scheduler holding its role must have had no subscriber of its probe
    subject (its process gone: killed, crashed) before a warm standby of its kind takes the role,
    without waiting for the lease to run out. Longer than a reconnect after NATS restarts."""
