"""The synthetic task: simulator workloads drawn deterministically and played as scripts."""

from __future__ import annotations

import pytest

from services.common import synthetic
from services.common.runconfig import RunConfig
from services.scheduler.feed import build_feed
from services.scheduler.synthetic_task import SyntheticTask
from services.scheduler.trajectory import CallTool, Finish, Generate, Trajectory


def _cfg(**task: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"dataset": "synthetic", "workload": "r2e_gym", "max_context_tokens": 40960, **task},
            "rollout": {"emulated": {"time_scale": 0.1}},
        }
    )


def test_remembered_draws_equal_fresh_ones_and_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic, "GROUP_MEMO", 3)
    wl, fresh = synthetic.Workload.load("r2e_gym"), synthetic.Workload.load("r2e_gym")
    keys = [(seed, index, step) for seed in (0, 1) for index in range(3) for step in (0, 2)]
    first = {k: wl.group_for(*k, f"p{k[1]}") for k in keys}
    for k in keys:
        assert wl.group_for(*k, f"p{k[1]}") == first[k] == fresh.group_for(*k, f"p{k[1]}")
    assert len(wl._groups) == 3
    assert first[(0, 0, 0)] != first[(1, 0, 0)] and first[(0, 0, 0)] != first[(0, 0, 2)]


def test_a_group_is_drawn_the_same_way_every_time_and_as_the_simulator_draws_it() -> None:
    cfg = _cfg(group_size=4)
    task = SyntheticTask(cfg.task, cfg.rollout.emulated.time_scale)
    ticket = build_feed(cfg.task, cfg.training).take(0)[0]
    first, again = task.group(ticket, 0), task.group(ticket, 0)
    assert first == again and len(first) == 4
    assert len({s.prompt_tokens for s in first}) == 1, "a group shares its prompt"
    script = task.script(first[0])
    assert [t.output_tokens for t in script] == [t.output_tokens for t in first[0].turns]
    tools = [t.tool for t in script if t.tool is not None]
    for turn, tool in zip([t for t in first[0].turns if t.tool], tools, strict=True):
        assert tool.tool == "synthetic" and tool.args["size"] == turn.tool.signal.size
        assert tool.args["status"] == turn.tool.signal.status
        assert tool.args["seconds"] == pytest.approx(turn.tool.latency_s * 0.1, abs=1e-4)
    assert script[-1].tool is None, "the last turn answers"


def test_the_live_stack_and_the_simulator_draw_the_same_groups_for_the_same_seed() -> None:
    """Common random numbers: the k-th group admitted is the same trajectories live and simulated
    (so `libra bench live` compares timing, not two different samples of a heavy-tailed workload)."""
    from services.common.cost_model import load_presets
    from services.policy.routing import build_router
    from services.policy.search import BucketPlan
    from services.simulation.simulator import Simulator
    from services.simulation.state import SystemConfig

    cfg = _cfg(group_size=4, seed=3)
    live = SyntheticTask(cfg.task, cfg.rollout.emulated.time_scale)
    tickets = build_feed(cfg.task, cfg.training).take(0)[:3]
    system = SystemConfig(
        "s", "async", 8, 2, [BucketPlan("all", 1, 2, float("inf"))], build_router([], "least_loaded")
    )
    sim = Simulator(system, live.workload, load_presets("H100", "qwen3-14b"), 10, 1, seed=3)
    sim.lives.admit(3)
    for k, ticket in enumerate(tickets):
        simulated = [sim.trajs[tid].spec for tid in sim.groups[k].trajs]
        drawn = live.group(ticket, 0)
        assert [s.turns for s in drawn] == [s.turns for s in simulated]
        assert [s.prompt_tokens for s in drawn] == [s.prompt_tokens for s in simulated]
    other = SyntheticTask(_cfg(group_size=4, seed=4).task, 1.0).group(tickets[0], 0)
    assert [s.turns for s in other] != [s.turns for s in live.group(tickets[0], 0)]


def test_a_scripted_trajectory_asks_for_exact_turn_lengths_and_calls_the_drawn_tools() -> None:
    cfg = _cfg(group_size=2, max_new_tokens=4096)
    task = SyntheticTask(cfg.task, cfg.rollout.emulated.time_scale)
    ticket = build_feed(cfg.task, cfg.training).take(0)[0]
    spec = next(s for s in task.group(ticket, 0) if len(s.turns) >= 2)
    script = task.script(spec)
    t = Trajectory(
        "t", "g", 0, 2, ticket.task, task.prompt_ids(spec), len(script), 4096, 40960, 0.0, script=script
    )
    action = t.first_action()
    for i, turn in enumerate(script):
        assert isinstance(action, Generate)
        assert action.max_new_tokens == action.min_new_tokens == min(turn.output_tokens, 4096)
        n = action.max_new_tokens
        action = t.on_turn([7] * n, [-1.0] * n, "", [0] * n, eos=False)
        if turn.tool is None:
            assert isinstance(action, Finish) and i == len(script) - 1
            break
        assert isinstance(action, CallTool) and action.request == turn.tool
        action = t.on_tool_return("ok", task.observation_ids("small"))
    assert t.finish is not None and t.finish.reward == 1.0


def test_a_synthetic_task_needs_a_workload_that_loads() -> None:
    with pytest.raises(ValueError, match="task.workload is required"):
        RunConfig.model_validate({"task": {"dataset": "synthetic"}})
    with pytest.raises(ValueError, match="no-such-workload"):
        RunConfig.model_validate({"task": {"dataset": "synthetic", "workload": "no-such-workload"}})


def test_a_groups_members_share_one_drawing_of_the_prompt_each_with_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.scheduler.episodes import SyntheticEpisode

    cfg = _cfg(group_size=4)
    episode = SyntheticEpisode(None, cfg.task, cfg.rollout.emulated.time_scale)  # type: ignore[arg-type]  # members need no tokenizer
    ticket = build_feed(cfg.task, cfg.training).take(0)[0]
    specs = episode.synthetic.group(ticket, 0)
    drawn = []
    original = SyntheticTask.prompt_ids
    monkeypatch.setattr(
        SyntheticTask, "prompt_ids", lambda self, spec: drawn.append(spec) or original(self, spec)
    )
    members = episode.members(ticket, 0, 4)
    assert len(drawn) == len({s.prompt_id for s in specs[:4]}) == 1
    assert [m.prompt_ids for m in members] == [original(episode.synthetic, s) for s in specs[:4]]
    assert len({id(m.prompt_ids) for m in members}) == 4  # a trajectory's context never aliases another's
    assert [m.script for m in members] == [episode.synthetic.script(s) for s in specs[:4]]
