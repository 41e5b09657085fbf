"""Config overrides from the command line (`--training.lr 1e-6`, `training.lr=1e-6`), "did you
mean" on unknown fields, and the job config the services get (overrides in, paths absolute)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigFileError, SettingsError
from services.common.runconfig import load_run_config, parse_run_config
from tools.cli import config_overrides
from tools.runner import job_config_yaml, with_local_paths
from tools.stack import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_overrides_in_every_spelling_set_any_field() -> None:
    args = ["--training.lr", "1e-6", "--task.max_turns=4", "rollout.engines=3", "--task.tools", "[python]"]
    overrides = config_overrides(args)
    assert overrides == ["training.lr=1e-6", "task.max_turns=4", "rollout.engines=3", "task.tools=[python]"]
    cfg = load_run_config(TINY, overrides)
    assert (cfg.training.lr, cfg.task.max_turns, cfg.rollout.engines) == (1e-6, 4, 3)
    assert cfg.task.tools == ["python"] and cfg.training.steps == 2  # the file's other values stay
    nested = parse_run_config("{}", "x", ["task.dataset={path: d.jsonl, answer_key: y}"])
    assert nested.task.dataset.path == "d.jsonl"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [["--bogus"], ["-v"], ["lr=1"], ["--training.lr"]])
def test_what_is_not_an_override_is_refused(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        config_overrides(bad)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.stps=3", "training.stps: Extra inputs are not permitted (got 3) — did you mean 'steps'?"),
        ("trainig.lr=1", "did you mean 'training'?"),
        ("rollout.buckets=[{name: a, tp: 2}]", "rollout.buckets.0.tp: Extra inputs are not permitted"),
        ("task.max_turns=0", "task.max_turns: Input should be greater than or equal to 1"),
        # what other RL frameworks call the field
        ("training.learning_rate=1e-6", "did you mean 'lr'?"),
        ("task.num_generations=8", "did you mean 'group_size'?"),
        ("task.max_completion_length=64", "did you mean 'max_new_tokens'?"),
        ("training.beta=0.01", "did you mean 'kl_coef'?"),
    ],
)
def test_a_bad_override_names_the_field_and_what_was_meant(override: str, message: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_run_config(TINY, [override])
    assert message in err.value.message and f"with {override}" in err.value.message


def test_an_override_addresses_an_item_of_a_list() -> None:
    """`rollout.buckets.0.engines=2`: the config's list, or its default's copy where it sets none."""
    two = "rollout: {engines: 3, buckets: [{name: a, max_output_tokens: 64}, {name: b}]}"
    cfg = parse_run_config(two, "x", ["rollout.buckets.1.engines=2", "rollout.buckets.0.engines=1"])
    assert [(b.name, b.engines) for b in cfg.rollout.buckets] == [("a", 1), ("b", 2)]
    cfg = load_run_config(TINY, ["rollout.buckets.0.engines=2", "rollout.buckets.0.max_context_tokens=1024"])
    assert [(b.name, b.engines, b.max_context_tokens) for b in cfg.rollout.buckets] == [("short", 2, 1024)]
    cfg = load_run_config(TINY, ["task.tools=[calculator, python]", "task.tools.1=calculator"])
    assert cfg.task.tools == ["calculator", "calculator"]
    for bad, message in (
        ("rollout.buckets.3.engines=1", "rollout.buckets has 1 item(s), numbered from 0; got '3'"),
        ("rollout.buckets.x.engines=1", "rollout.buckets: Input should be a valid list"),
        ("training.lr.0=1", "training.lr is 0.0001, not a list"),
    ):
        with pytest.raises(ConfigFileError) as err:
            load_run_config(TINY, [bad])
        assert message in err.value.message, err.value.message


def test_an_override_into_a_value_or_without_a_value_is_a_clear_error() -> None:
    with pytest.raises(ConfigFileError) as err:
        load_run_config(TINY, ["model.source.x=1"])
    assert "model.source is 'tiny-random', not a section" in err.value.message
    with pytest.raises(ConfigFileError) as err:
        load_run_config(TINY, ["training."])
    assert "is not KEY=VALUE" in err.value.message


def test_the_job_config_carries_the_overrides_and_absolute_paths(tmp_path: Path) -> None:
    cfg = load_run_config(ROOT / "configs" / "custom_example.yaml", ["training.steps=3"])
    local = with_local_paths(cfg, tmp_path / "out")
    sent = yaml.safe_load(job_config_yaml(local))
    assert sent["training"]["steps"] == 3
    assert sent["training"]["checkpoint_dir"] == str(tmp_path / "out" / "{run_id}" / "checkpoints")
    assert (
        Path(sent["task"]["dataset"]["path"]).is_absolute()
        and Path(sent["task"]["dataset"]["path"]).is_file()
    )
    assert all(Path(p).is_absolute() for p in sent["task"]["plugin_paths"] + sent["task"]["tool_plugins"])
    # the per-user model cache: each service resolves it on its own host (a path set is made absolute)
    assert "cache_dir" not in sent.get("model", {})
    mine = with_local_paths(load_run_config(None, ["model.cache_dir=models"]), tmp_path)
    assert mine.model.cache_dir == str(Path.cwd() / "models")
    assert "lr_schedule" not in sent["training"]  # only what was set travels: defaults stay the services'
    again = parse_run_config(job_config_yaml(local), "sent")
    assert again == local


def test_shipped_configs_are_found_by_name_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.cli import CONFIG_DIR, config_path, main, shipped_configs

    monkeypatch.chdir(tmp_path)  # no configs/ here: the packaged ones answer
    assert {"default.yaml", "gpu.yaml", "tiny.yaml"} <= set(shipped_configs())
    for name in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
        assert config_path(name) == CONFIG_DIR / "tiny.yaml"
    mine = tmp_path / "tiny.yaml"  # a file of the user's wins over the shipped one
    mine.write_text("name: mine\n")
    assert config_path("tiny.yaml").resolve() == mine
    with pytest.raises(ConfigFileError) as err:
        config_path("tinny")
    assert "shipped configs, usable by name: " in err.value.message and "tiny.yaml" in err.value.message
    with pytest.raises(ConfigFileError):
        config_path("elsewhere/gpu.yaml")  # a path that names a directory is never replaced
    assert main(["config", "show", "gpu"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["backend"] == "vllm"
    assert main(["config", "list"]) == 0
    listed = capsys.readouterr().out
    assert "learn.yaml" in listed and "cores in a few minutes." in listed  # default's whole sentence
    from tools.cli import header_summary

    header = "# First line of a sentence that\n# ends here. A second one.\n#\nname: x\n# not header\n"
    assert header_summary(header) == "First line of a sentence that ends here."


def test_relative_paths_in_a_config_file_are_the_files_and_overrides_are_the_shells(
    tmp_path, monkeypatch
) -> None:
    from services.common.runconfig import load_run_config

    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    cfg = project / "configs" / "mine.yaml"
    cfg.write_text(
        "task:\n  dataset: {path: ../data/train.jsonl}\n  plugin_paths: [../plugins, /abs/plugins]\n"
        "  tool_plugins: [tools/t.py]\ntraining:\n  checkpoint_dir: ckpt/{run_id}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_run_config(cfg)
    assert loaded.task.dataset.path == str(project / "configs" / ".." / "data" / "train.jsonl")  # type: ignore[union-attr]
    assert loaded.task.plugin_paths == [str(project / "configs" / ".." / "plugins"), "/abs/plugins"]
    assert loaded.task.tool_plugins == [str(project / "configs" / "tools" / "t.py")]
    assert loaded.training.checkpoint_dir == str(project / "configs" / "ckpt" / "{run_id}")
    assert loaded.model.cache_dir == ""  # the default: the per-user cache, found where it runs
    # an override is typed where the command runs: it stays relative until the job is submitted
    over = load_run_config(cfg, ["task.dataset.path=mine.jsonl"])
    assert over.task.dataset.path == "mine.jsonl"  # type: ignore[union-attr]
    assert with_local_paths(over, tmp_path).task.dataset.path == str(elsewhere / "mine.jsonl")  # type: ignore[union-attr]


def test_config_show_prints_the_resolved_config_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    assert main(["config", "show", "tiny", "--training.lr", "1e-6", "--rollout.buckets.0.engines", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ") and "resolved" in out.splitlines()[0]
    data = yaml.safe_load(out)
    assert data["training"]["lr"] == 1e-6 and data["training"]["steps"] == 2  # the file's, overridden
    assert data["rollout"]["buckets"][0]["engines"] == 2 and "policy" in data["rollout"]  # defaults too
    assert main(["config", "show", "tiny"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "tiny.yaml").read_text()  # as written
