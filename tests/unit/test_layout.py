"""The layout searched from the workload before a job starts (`planner.layout.search`): the
proposals are the simulator's planner's, each written as the job's config and judged by simulating
that config; the config's own layout stays unless one beats it by `min_gain`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from services.common.config import ConfigFileError
from services.common.runconfig import RunConfig
from services.common.synthetic import Workload
from services.policy.assign import StaticAssigner
from services.policy.search import BucketPlan, Plan
from services.simulation.live import job_gpus
from tools.layout import choose_layout, label, proposals, summary, with_plan

WORKLOAD = str(Path(__file__).parents[1] / "e2e" / "workloads" / "tiny_tools.yaml")


def job(**layout: Any) -> dict[str, Any]:
    """An emulated job on 32 GPUs: 8 training, 8 TP1 + 8 TP2 engines (the bench-live layout)."""
    return {
        "name": "planned",
        "model": {"source": "tiny-random"},
        "task": {"dataset": "synthetic", "workload": WORKLOAD, "group_size": 2, "max_context_tokens": 512},
        "rollout": {
            "engines": 16,
            "backend": "emulated",
            "buckets": [
                {"name": "short", "tensor_parallel": 1, "max_output_tokens": 20},
                {"name": "long", "tensor_parallel": 2},
            ],
            "max_batch": 8,
        },
        "training": {
            "backend": "emulated",
            "steps": 4,
            "groups_per_step": 4,
            "emulated_gpus": 8,
            "emulated_tp": 2,
        },
        "planner": {"replan": False, "layout": {"search": True, "seeds": 2, **layout}},
    }


def test_bucket_engines_are_all_or_none_and_sum_to_the_engines() -> None:
    data = job()
    assert RunConfig.model_validate(data).bucket_engines == {"short": 8, "long": 8}
    data["rollout"]["buckets"][0]["engines"] = 12
    with pytest.raises(ValidationError, match="every bucket or none"):
        RunConfig.model_validate(data)
    data["rollout"]["buckets"][1]["engines"] = 3
    with pytest.raises(ValidationError, match="sum to rollout.engines"):
        RunConfig.model_validate(data)
    data["rollout"]["buckets"][1]["engines"] = 4
    assert RunConfig.model_validate(data).bucket_engines == {"short": 12, "long": 4}


def test_the_assigner_fills_each_bucket_to_its_share() -> None:
    a = StaticAssigner(["short", "long"], {"short": 3, "long": 1})
    slots: dict[str, Any] = {}
    for i in range(5):
        slot = a.assign(f"e{i}", "rollout-engine", "", slots)
        assert slot is not None
        slots[slot.worker_id] = slot
    assert [s.bucket for s in slots.values()] == ["short", "long", "short", "short", "short"]  # 3:1
    # an engine that names its bucket still gets it
    slot = a.assign("e9", "rollout-engine", "long", slots)
    assert slot is not None and slot.bucket == "long"


def test_search_needs_emulated_engines_training_and_a_workload() -> None:
    data = job()
    data["rollout"]["backend"] = "hf"
    with pytest.raises(ValidationError, match="planner.layout.search needs"):
        RunConfig.model_validate(data)


def test_a_plan_becomes_the_jobs_config() -> None:
    cfg = RunConfig.model_validate(job())
    plan = Plan(16, 4, [BucketPlan("short", 1, 4, 37.2), BucketPlan("long", 4, 3, float("inf"))])
    c = with_plan(cfg, plan, lend_tp=8)
    assert c.training.emulated_gpus == 16 and c.training.emulated_tp == 4
    assert c.rollout.engines == 7 and c.bucket_engines == {"short": 4, "long": 3}
    assert [(b.tensor_parallel, b.max_output_tokens) for b in c.rollout.buckets] == [(1, 38), (4, None)]
    assert (c.planner.lending.engines, c.planner.lending.tensor_parallel) == (2, 8)
    assert c.engines_needed == 9 and job_gpus(c) == 32 and not c.planner.layout.search
    assert label(c) == "train16/4xTP1+3xTP4/lend2xTP8"
    assert c.task == cfg.task and c.rollout.max_batch == cfg.rollout.max_batch  # the rest is the job's


def test_proposals_past_max_engines_are_left_out_with_the_reason() -> None:
    cfg = RunConfig.model_validate(job(max_engines=4))
    props, left = proposals(cfg, Workload.load(WORKLOAD), 32)
    assert props and all(p.cfg.engines_needed <= 4 for p in props)
    assert all(job_gpus(p.cfg) == 32 for p in props)  # every proposal lays out the same GPUs
    assert any("max_engines 4" in why for why in left)
    assert len({p.label for p in props}) == len(props)


def test_the_best_finalist_wins_over_the_configs_own_layout() -> None:
    cfg = RunConfig.model_validate(job(max_engines=16))
    chosen, d = choose_layout(cfg, progress=False)
    assert d["gpus"] == 32 and d["scored"] == d["proposals"] and d["steps_simulated"] == 4
    means = {r["label"]: r["trajectories_per_s"] for r in d["finalists"]}
    own = d["config"]["label"]
    assert own.endswith("(config)") and own in means and len(means) >= 2
    best = max(means, key=lambda k: means[k])
    if means[best] >= means[own] * 1.03 and best != own:
        assert d["chosen"] == best == label(chosen)
        assert d["predicted_gain"] == pytest.approx(means[best] / means[own] - 1)
    else:
        assert d["chosen"] == own
    assert not chosen.planner.layout.search and chosen.engines_needed == d["engines"] <= 16
    assert d["chosen"].removesuffix(" (config)") in summary(d)


def test_the_configs_own_layout_stays_unless_a_proposal_beats_it_by_min_gain() -> None:
    cfg = RunConfig.model_validate(job(max_engines=16, min_gain=1.0))  # +100 %: none does
    chosen, d = choose_layout(cfg, progress=False)
    assert d["chosen"] == d["config"]["label"] and d["predicted_gain"] == 0.0
    assert label(chosen) == label(cfg) and chosen.rollout == cfg.rollout


def test_gpus_that_cannot_hold_the_job_are_a_clear_error() -> None:
    cfg = RunConfig.model_validate(job(gpus=2))  # Qwen3-14B's training state alone needs more
    with pytest.raises(ConfigFileError) as err:
        choose_layout(cfg, progress=False)
    assert "planner.layout: 2 GPUs cannot hold training" in err.value.message


def test_libra_config_plan_prints_the_decision_and_writes_the_chosen_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.cli import main

    src = tmp_path / "job.yaml"
    data = job(max_engines=16)
    data["planner"]["layout"]["search"] = False  # `libra config plan` searches whatever the file says
    src.write_text(yaml.safe_dump(data))
    out = tmp_path / "chosen.yaml"
    assert main(["config", "plan", str(src), "--planner.layout.seeds", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layout search on 32 GPUs" in printed and "chosen: " in printed
    chosen = RunConfig.model_validate(yaml.safe_load(out.read_text()))
    assert f"chosen: {label(chosen)}" in printed.replace(" (config)", "")
    assert not chosen.planner.layout.search and job_gpus(chosen) == 32


def test_the_run_summary_says_which_layout_ran(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import print_summary

    report = {
        "status": "completed",
        "all_engines_on_final_version": True,
        "policy_versions_per_step": [],
        "logprob_mismatch_per_step": [],
        "layout": {"chosen": "train16/2xTP8", "engines": 2, "predicted_gain": 0.349},
    }
    assert print_summary(report) == 0
    assert "train16/2xTP8 (2 engines, predicted +34.9% over the config's)" in capsys.readouterr().out


def test_libra_up_starts_the_engines_the_searched_layout_needs() -> None:
    from tools.cli import stack_engines

    cfg = RunConfig.model_validate(job(max_engines=16))
    chosen, _ = choose_layout(cfg, progress=False)
    assert stack_engines(cfg) == chosen.engines_needed  # the job's own search then finds them
    data = job()
    data["planner"]["layout"]["search"] = False
    assert stack_engines(RunConfig.model_validate(data)) == 16  # no search: the config's engines
