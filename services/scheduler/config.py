"""Scheduler settings (env prefix LIBRA_SCHEDULER_); the job itself comes from the YAML run config."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LIBRA_SCHEDULER_", extra="ignore", use_attribute_docstrings=True
    )

    turn_timeout_s: float = Field(600.0, gt=0)
    """A turn request with no result after this long is re-sent to another engine."""
    max_turn_retries: int = Field(2, ge=0)
    """Re-sends of one turn before the trajectory ends with finish=error."""
    tool_grace_s: float = Field(15.0, gt=0)
    """Extra seconds beyond the tool's own timeout before the scheduler records a timeout itself."""
    lost_turn_grace_s: float = Field(2.0, gt=0)
    """A turn sent this recently may not be in the engine's load report yet; older ones missing from
    two reports in a row were lost and are re-sent."""
    max_tool_retries: int = Field(1, ge=0)
    """Re-sends of a tool call that no sandbox answered before the trajectory fails (never trained)."""
    engine_wait_s: float = Field(300.0, gt=0)
    """How long to wait for the configured number of engines before starting with fewer."""
    tick_s: float = Field(0.2, gt=0)
    """Period of the feed and watchdog loop."""
