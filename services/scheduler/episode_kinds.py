"""Which episode a run's task gets: the synthetic workload's, a user's environment's, a user's agent's
over the OpenAI-compatible endpoint, or the built-in tool-use loop's."""

from __future__ import annotations

from services.common.bus import Bus
from services.common.runconfig import TaskConfig
from services.common.tls import TlsFiles
from services.scheduler.agent_episode import AgentEpisode
from services.scheduler.episodes import EnvironmentEpisode, Episode, Spawn, SyntheticEpisode
from services.scheduler.prompting import Prompter
from services.scheduler.sandboxed_agents import SandboxedAgents


def build_episode(
    task: TaskConfig,
    model_source: str,
    time_scale: float,
    prompter: Prompter,
    spawn: Spawn,
    endpoint: tuple[str, int],
    tls: TlsFiles | None = None,
    bus: Bus | None = None,
) -> Episode:
    """The episode for the job's `task` (`dataset: synthetic`, `environment` and `agent` exclude
    each other; the config checks it). `model_source`: the model an agent's calls name;
    `time_scale`: the emulated engines' (the synthetic task's tool waits scale with it);
    `endpoint`: where a `task.agent`'s OpenAI-compatible endpoint listens (host, port; 0 picks a
    free one), served with `tls` (the scheduler's certificate) beyond loopback; `bus`: where a
    sandboxed agent (`task.agent_sandbox`) is asked of the tool sandboxes."""
    if task.dataset == "synthetic":
        return SyntheticEpisode(prompter, task, time_scale)
    if task.runs_agent:
        sandboxed = None
        if task.agent_sandbox:
            assert bus is not None, "a sandboxed agent is asked for over the bus"
            sandboxed = SandboxedAgents(bus, task.agent_timeout_s)
        return AgentEpisode(prompter, task, model_source, spawn, *endpoint, tls, sandboxed)
    if task.environment:
        return EnvironmentEpisode(prompter, task, spawn)
    return Episode(prompter)
