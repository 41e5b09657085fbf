"""Which episode a run's task gets: the synthetic workload's, a user's environment's, a user's agent's
over the OpenAI-compatible endpoint, or the built-in tool-use loop's."""

from __future__ import annotations

from services.common.runconfig import RunConfig
from services.common.tls import TlsFiles
from services.scheduler.agent_episode import AgentEpisode
from services.scheduler.episodes import EnvironmentEpisode, Episode, Spawn, SyntheticEpisode
from services.scheduler.prompting import Prompter


def build_episode(
    cfg: RunConfig, prompter: Prompter, spawn: Spawn, endpoint: tuple[str, int], tls: TlsFiles | None = None
) -> Episode:
    """The episode for the run config's task (`task.dataset: synthetic`, `task.environment` and
    `task.agent` exclude each other; RunConfig checks it). `endpoint`: where a `task.agent`'s
    OpenAI-compatible endpoint listens (host, port; 0 picks a free one), served with `tls` (the
    scheduler's certificate) beyond loopback."""
    if cfg.task.dataset == "synthetic":
        return SyntheticEpisode(prompter, cfg)
    if cfg.task.runs_agent:
        return AgentEpisode(prompter, cfg, spawn, *endpoint, tls)
    if cfg.task.environment:
        return EnvironmentEpisode(prompter, cfg, spawn)
    return Episode(prompter)
