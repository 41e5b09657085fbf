"""Scheduler settings (env prefix LIBRA_SCHEDULER_); the job itself comes from the YAML run config."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LIBRA_SCHEDULER_", extra="ignore", use_attribute_docstrings=True
    )

    turn_timeout_s: float | None = Field(None, gt=0)
    """A turn request with no result after this long is re-sent to another engine. Unset: derived
    from the turn's token budget, `turn_timeout_base_s + turn_timeout_s_per_token × max_new_tokens`.
    A last resort: a dead or hung engine's turns move when it leaves the plan or stops reporting them."""
    turn_timeout_base_s: float = Field(60.0, gt=0)
    """Fixed part of the derived turn timeout (queueing, prefill, a weight swap)."""
    turn_timeout_s_per_token: float = Field(0.25, gt=0)
    """Per-token part of the derived turn timeout: a generous bound on one decode step under load."""

    def turn_timeout(self, max_new_tokens: int) -> float:
        if self.turn_timeout_s is not None:
            return self.turn_timeout_s
        return self.turn_timeout_base_s + self.turn_timeout_s_per_token * max_new_tokens

    handovers: int = Field(8, ge=1)
    """Finished trajectories stored in JetStream for the trainer at once, off the turn-result path.
    Unbounded, hundreds of stores at 1,024 engines on 2 cores timed out together and the
    subscriptions overflowed; one at a time, every result waited behind a store (0.1-0.6 s each)."""
    context_deltas: bool = True
    """A turn going back to the engine that served the trajectory's last one carries only the
    tokens after what that engine holds (services/common/held_context.py); False: every turn
    carries its whole context."""
    max_turn_retries: int = Field(2, ge=0)
    """Re-sends of one turn before the trajectory ends with finish=error."""
    max_invalid_results: int = Field(3, ge=1)
    """Invalid turn results in a row (tokens outside the vocabulary, bad logprobs, versions the
    trainer never made, more tokens than asked) after which an engine is taken out of routing for
    the rest of its lease, while another engine serves: a broken or compromised engine must not
    keep failing turns."""
    tool_grace_s: float = Field(15.0, gt=0)
    """Extra seconds beyond the tool's own timeout before the scheduler records a timeout itself."""
    handback_wait_s: float = Field(5.0, gt=0)
    """How long the turns of an engine moved out of rollout (drained, parked) wait for it to hand
    them back, with what they generated, before they are re-sent without it."""
    answered_grace_s: float = Field(10.0, gt=0)
    """A turn its engine says it answered is lost only if its result has not come this long after
    the engine first said so (a result NATS dropped; a slow reader is not a loss)."""
    lost_turn_grace_s: float = Field(2.0, gt=0)
    """A turn sent this recently may not be in the engine's load report yet; older ones missing from
    two reports in a row were lost and are re-sent."""
    max_tool_retries: int = Field(1, ge=0)
    """Re-sends of a tool call that no sandbox answered before the trajectory fails (never trained)."""
    engine_wait_s: float = Field(300.0, gt=0)
    """How long to wait for the configured number of engines before starting with fewer."""
    tick_s: float = Field(0.2, gt=0)
    """Period of the feed and watchdog loop."""
    stats_interval_s: float = Field(5.0, gt=0)
    """Period of the workload-stats event (`workload.stats`) for the planner."""
    stats_window_s: float = Field(60.0, gt=0)
    """The workload stats cover this much of the recent past."""
    agent_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible endpoint that `task.agent` runs call (beside the scheduler;
    loopback: no other machine reaches it). Any other address serves HTTPS with the scheduler's
    certificate (LIBRA_TLS_CERT_FILE, LIBRA_TLS_KEY_FILE) and is refused without one."""
    agent_port: int = Field(0, ge=0, le=65535)
    """Its port (0: a free one, handed to each agent run in its base URL)."""
    policy_save_s: float = Field(10.0, gt=0)
    """How often what the routing policy learned (C-MLFQ's prefix trees) is saved to Redis."""
