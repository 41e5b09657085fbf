"""Which episode a run's task gets: the synthetic workload's, a user's environment's, a user's agent's
over the OpenAI-compatible endpoint, or the built-in tool-use loop's."""

from __future__ import annotations

from services.common.runconfig import TaskConfig
from services.common.tls import TlsFiles
from services.scheduler.agent_episode import AgentEpisode
from services.scheduler.episodes import EnvironmentEpisode, Episode, Spawn, SyntheticEpisode
from services.scheduler.prompting import Prompter


def build_episode(
    task: TaskConfig,
    model_source: str,
    time_scale: float,
    prompter: Prompter,
    spawn: Spawn,
    endpoint: tuple[str, int],
    tls: TlsFiles | None = None,
) -> Episode:
    """The episode for the job's `task` (`dataset: synthetic`, `environment` and `agent` exclude
    each other; the config checks it). `model_source`: the model an agent's calls name;
    `time_scale`: the emulated engines' (the synthetic task's tool waits scale with it);
    `endpoint`: where a `task.agent`'s OpenAI-compatible endpoint listens (host, port; 0 picks a
    free one), served with `tls` (the scheduler's certificate) beyond loopback."""
    if task.dataset == "synthetic":
        return SyntheticEpisode(prompter, task, time_scale)
    if task.runs_agent:
        return AgentEpisode(prompter, task, model_source, spawn, *endpoint, tls)
    if task.environment:
        return EnvironmentEpisode(prompter, task, spawn)
    return Episode(prompter)
