"""Versioned, run-scoped NATS subjects: libra.v1.<run>.<domain>.<event>."""

from __future__ import annotations

TURN_REQUEST = "turn.request"  # .<engine_id>
TURN_RESULT = "turn.result"  # .<kind>.<worker_id> (spoken, below)
TURN_PROGRESS = "turn.progress"  # .<kind>.<worker_id>: a streamed turn's tokens so far (spoken)
TOOL_CALL = "tool.call"
TOOL_RETURN = "tool.return"
AGENT_RUN = "agent.run"  # the scheduler asks the tool sandboxes to run a sandboxed agent
AGENT_ACCEPTED = "agent.accepted"  # .<kind>.<worker_id>: the sandbox that took the run (spoken)
AGENT_CANCEL = "agent.cancel"  # the scheduler stops a run (every sandbox hears it)
AGENT_RETURN = "agent.return"  # .<kind>.<worker_id>: how a sandboxed agent run ended (spoken)
TRAJ_COMPLETED = "traj.completed"
TRAJ_SAMPLE = "traj.sample"  # a completed trajectory's text, for the job's samples
GROUP_OUTCOME = "group.outcome"
ENGINE_LOAD = "engine.load"
WORKER_HELLO = "worker.hello"  # .<kind>.<worker_id>
PLAN = "plan.current"
ROLE_CHANGE = "plan.role_change"
ROLE_REQUEST = "plan.role_request"  # the operator asks the planner to move a worker (request/reply)
LEND_REQUEST = "plan.lend_request"  # the trainer asks the planner to lend or reclaim its GPUs' engines
HYBRID_STATE = "hybrid.state"  # a worker's progress into training and back
HYBRID_GROUP = "hybrid.group"  # the trainer's data-parallel group of a generation
WEIGHTS_UPDATED = "weights.updated"
TRAIN_METRICS = "train.metrics"
METRICS = "metrics"  # .<kind>.<worker_id>
ERRORS = "errors"
SCHEDULER_STATS = "scheduler.stats"
ALIVE = "alive"  # .<kind>.<worker_id>: the planner asks a role holder whether it is there
WORKLOAD_STATS = "workload.stats"
FACTS = "facts"  # .<service>: what it owns that a job's report reads (services/common/facts.py)
FACTS_TRAINER = f"{FACTS}.trainer"
FACTS_SCHEDULER = f"{FACTS}.scheduler"
FACTS_PLANNER = f"{FACTS}.planner"


SPOKEN = (
    WORKER_HELLO,
    HYBRID_STATE,
    ENGINE_LOAD,
    TURN_RESULT,
    TURN_PROGRESS,
    METRICS,
    ERRORS,
    AGENT_ACCEPTED,
    AGENT_RETURN,
)
"""Where a worker speaks for itself: it publishes on `<subject>.<kind>.<worker_id>`, a subject only
its own NATS user may publish to (services/common/credentials.py), and a receiver takes the sender
from the subject, refusing a message whose body claims another (services/common/bus.py)."""


def spoken(base: str, kind: str, worker_id: str) -> str:
    return f"{base}.{kind}.{worker_id}"


def speaker(subject: str) -> tuple[str, str]:
    """(kind, worker id) of a spoken subject: its last two tokens."""
    *_, kind, worker_id = subject.split(".")
    return kind, worker_id


def subject(run_id: str, *parts: str) -> str:
    return ".".join(("libra", "v1", run_id, *parts))


def stream_name(run_id: str, what: str) -> str:
    """JetStream stream names cannot contain dots; one stream per durable event kind and run."""
    return f"LIBRA_{run_id}_{what}".replace("-", "_").upper()
