"""Trainer process settings (LIBRA_TRAINER_*); the job's training knobs live in the run config."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LIBRA_TRAINER_", extra="ignore", use_attribute_docstrings=True
    )

    fetch_batch: int = Field(64, ge=1, le=10_000)
    """Completed trajectories pulled from JetStream per fetch."""
    idle_poll_s: float = Field(1.0, gt=0.0, le=60.0)
    """How long one fetch waits for trajectories; also how quickly the loop notices a shutdown."""
    resume: bool = True
    """Resume from the newest checkpoint under training.checkpoint_dir when one exists."""
    keep_checkpoints: int = Field(2, ge=2)
    """Checkpoints kept on disk; older ones are deleted after each new one is written."""
    ack_wait_s: float = Field(60.0, gt=1.0)
    """JetStream ack wait of the trajectory consumer: a delivery not acked by then is redelivered, so
    a dead trainer's work comes back this fast; the live trainer marks what it holds in progress
    every ack_wait_s / 3."""
    assignment_timeout_s: float = Field(30.0, gt=0.0)
    """How long to wait for the planner's "train" assignment before logging again and re-waiting."""
    push_retries: int = Field(3, ge=0, le=20)
    """Extra attempts for an engine whose weight push failed."""
    push_backoff_s: float = Field(0.5, ge=0.0)
    """First retry delay of a failed push; it doubles with each attempt."""
    push_timeout_s: float = Field(300.0, gt=0.0)
    """Deadline of one PushWeights call."""
    resync_interval_s: float = Field(5.0, gt=0.0)
    """How often engines that miss the current weights (new, restarted, failed) are pushed again."""
