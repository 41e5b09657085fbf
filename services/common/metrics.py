"""Prometheus metrics: every service serves its own on `LIBRA_METRICS_ADDR:LIBRA_METRICS_PORT`
(loopback by default; `libra up` picks a port per service and prints the addresses).

Each service registers only its own families, once per process: a service runs job after job in one
process, so counters count over the process's life and gauges show the job now running. Names are
`libra_<service>_*`; docs/observability.md lists them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def serve_metrics(addr: str, port: int) -> int:
    """Starts the HTTP exporter on a daemon thread; returns the port it listens on."""
    server, _ = start_http_server(port, addr=addr)
    return int(server.server_port)


@dataclass(frozen=True)
class SchedulerMetrics:
    trajectories: Counter
    failed: Counter
    turns: Counter
    tool_calls: Counter
    in_flight: Gauge
    queued: Gauge
    running: Gauge
    reward: Histogram
    latency: Histogram
    trained_version: Gauge


@cache
def scheduler_metrics() -> SchedulerMetrics:
    return SchedulerMetrics(
        trajectories=Counter("libra_scheduler_trajectories", "Trajectories finished (failed ones too)"),
        failed=Counter("libra_scheduler_trajectories_failed", "Trajectories failed, by code", ["code"]),
        turns=Counter("libra_scheduler_turns", "Generation turns completed"),
        tool_calls=Counter("libra_scheduler_tool_calls", "Tool calls returned, by status", ["status"]),
        in_flight=Gauge("libra_scheduler_in_flight", "Trajectories in flight"),
        queued=Gauge(
            "libra_scheduler_queue_depth", "Turns waiting for an engine slot, by bucket", ["bucket"]
        ),
        running=Gauge("libra_scheduler_running", "Turns running on engines, by bucket", ["bucket"]),
        reward=Histogram("libra_scheduler_reward", "Reward of finished trajectories", buckets=REWARD_BUCKETS),
        latency=Histogram(
            "libra_scheduler_trajectory_seconds",
            "Trajectory latency, launch to finish",
            buckets=LATENCY_BUCKETS,
        ),
        trained_version=Gauge(
            "libra_scheduler_trained_version", "Newest weight version the scheduler heard of"
        ),
    )


@dataclass(frozen=True)
class EngineMetrics:
    running: Gauge
    waiting: Gauge
    tokens: Counter
    tokens_per_s: Gauge
    weight_version: Gauge
    free_kv_tokens: Gauge
    turns: Counter
    drafted: Counter
    accepted: Counter
    acceptance: Gauge


@cache
def engine_metrics() -> EngineMetrics:
    return EngineMetrics(
        running=Gauge("libra_engine_running", "Sequences decoding"),
        waiting=Gauge("libra_engine_waiting", "Requests waiting for a batch slot (or held for weights)"),
        tokens=Counter("libra_engine_generated_tokens", "Tokens generated"),
        tokens_per_s=Gauge("libra_engine_tokens_per_second", "Generation rate over the last load interval"),
        weight_version=Gauge("libra_engine_weight_version", "Weight version served"),
        free_kv_tokens=Gauge("libra_engine_free_kv_tokens", "Free KV-cache tokens (vllm; hf: -1)"),
        turns=Counter("libra_engine_turns", "Turns answered, by finish reason", ["finish"]),
        drafted=Counter("libra_engine_spec_drafted_tokens", "Drafted tokens verified (speculative decoding)"),
        accepted=Counter("libra_engine_spec_accepted_tokens", "Drafted tokens the verifier accepted"),
        acceptance=Gauge(
            "libra_engine_spec_acceptance_rate", "Accepted / drafted tokens since the engine started"
        ),
    )


@dataclass(frozen=True)
class TrainerMetrics:
    steps: Counter
    step_seconds: Histogram
    weight_version: Gauge
    reward: Gauge
    trajectories: Counter
    push_seconds: Histogram
    push_bytes: Counter


@cache
def trainer_metrics() -> TrainerMetrics:
    return TrainerMetrics(
        steps=Counter("libra_trainer_steps", "Training steps committed"),
        step_seconds=Histogram("libra_trainer_step_seconds", "Train step time", buckets=LATENCY_BUCKETS),
        weight_version=Gauge("libra_trainer_weight_version", "Weight version committed"),
        reward=Gauge("libra_trainer_reward_mean", "Mean reward of the last step's sampled trajectories"),
        trajectories=Counter(
            "libra_trainer_trajectories", "Trajectories consumed by steps (trained and filtered)"
        ),
        push_seconds=Histogram("libra_trainer_push_seconds", "Weight push time", buckets=LATENCY_BUCKETS),
        push_bytes=Counter("libra_trainer_push_bytes", "Bytes the trainer uploaded in weight pushes"),
    )


@dataclass(frozen=True)
class SandboxMetrics:
    calls: Counter
    seconds: Histogram


@cache
def sandbox_metrics() -> SandboxMetrics:
    return SandboxMetrics(
        calls=Counter(
            "libra_sandbox_tool_calls", "Tool calls executed, by tool and status", ["tool", "status"]
        ),
        seconds=Histogram(
            "libra_sandbox_tool_seconds", "Tool call wall time", ["tool"], buckets=LATENCY_BUCKETS
        ),
    )


@dataclass(frozen=True)
class PlannerMetrics:
    plans: Counter
    plan_version: Gauge
    workers: Gauge
    decision_s: Histogram


@cache
def planner_metrics() -> PlannerMetrics:
    return PlannerMetrics(
        plans=Counter("libra_planner_plans", "Plans published"),
        plan_version=Gauge("libra_planner_plan_version", "Version of the plan in force"),
        workers=Gauge("libra_planner_workers", "Workers in the plan, by role", ["role"]),
        decision_s=Histogram(
            "libra_planner_decision_seconds",
            "Wall seconds a re-fit decision spent simulating its candidates",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        ),
    )
