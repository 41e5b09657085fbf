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
    assignment_timeout_s: float = Field(30.0, gt=0.0)
    """How long to wait for the planner's "train" assignment before logging again and re-waiting."""
    push_retries: int = Field(3, ge=0, le=20)
    """Extra attempts for an engine whose weight push failed."""
    push_backoff_s: float = Field(0.5, ge=0.0)
    """First retry delay of a failed push; it doubles with each attempt."""
    push_timeout_s: float = Field(300.0, gt=0.0)
    """Deadline of one PushWeights call."""
    lend_timeout_s: float = Field(30.0, gt=0.0)
    """How long the trainer asks the planner to take its lent GPUs back before it trains anyway
    (a planner restarting; the engines are taken back at the next step)."""
    resync_interval_s: float = Field(5.0, gt=0.0)
    """How often engines that miss the current weights (new, restarted, failed) are pushed again."""
    hybrid_host: str = "127.0.0.1"
    """Where the hybrid pool's rendezvous (a torch.distributed TCPStore) listens; 0.0.0.0 on a cluster."""
    hybrid_port: int = Field(0, ge=0, le=65535)
    """Its port (0: any free port; the group announcement carries it)."""
    hybrid_advertise_host: str = ""
    """The host name hybrid workers reach it at (default: hybrid_host)."""
    hybrid_timeout_s: float = Field(60.0, gt=0.0)
    """How long a generation waits for its members to meet, and any collective for its peers: a
    worker killed or cut off while joining or training is dropped after this."""
    hybrid_ping_s: float = Field(15.0, gt=0.0)
    """While the trainer waits for data, it pings its group this often (below hybrid_timeout_s)."""
