"""`libra calibrate`'s fit: decode, prefill and weight-load timings made by a known cost model are
fitted back to its constants, and the profile it writes loads as that cost model."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from services.common.cost_model import Calibration, CostModel, GPUSpec, ModelSpec, load_profile
from tools.calibrate import Sample, fit

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
    out += [Sample("prefill", cm.prefill_s(p, 0, 1), tokens=p) for p in (64, 256, 1024)]
    out += [
        Sample("weights", n / cm.gpu.net_bw + cm.calib.sync_fixed_s, bytes=n)
        for n in (1 << 27, 1 << 28, 1 << 29)
    ]
    return out


def test_the_fit_recovers_the_constants_that_made_the_timings() -> None:
    truth = _truth()
    got = fit(_samples(truth), MODEL, "cpu", 8e9)
    assert got["fit_error"]["decode_rel_rms"] < 0.05 and got["fit_error"]["prefill_rel_rms"] < 1e-6
    assert got["fit_error"]["weights_rel_rms"] < 1e-6
    assert got["gpu"]["net_bw"] == pytest.approx(3e9, rel=1e-6)
    assert got["calibration"]["sync_fixed_s"] == pytest.approx(0.05, rel=1e-6)
    assert got["calibration"]["decode_overhead_s"] == pytest.approx(0.004, rel=0.25)
    fitted = CostModel(GPUSpec(**got["gpu"]), MODEL, Calibration(**got["calibration"]))
    for b, c in ((2, 128), (32, 256)):  # between the measured points
        assert fitted.decode_step_s(b, c, 1) == pytest.approx(truth.decode_step_s(b, c, 1), rel=0.1)
    assert fitted.prefill_s(512, 0, 1) == pytest.approx(truth.prefill_s(512, 0, 1), rel=0.05)


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
