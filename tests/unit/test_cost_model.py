import pytest

from services.common.cost_model import CostModel, GPUSpec, ModelSpec, Profile

GPU = GPUSpec("A800", flops=312e12, mem_bw=2.039e12, mem_bytes=80e9)
MODEL = ModelSpec("14b", 14.8e9, 14.8e9, layers=40, hidden=5120, kv_heads=8, head_dim=128)


def cm() -> CostModel:
    return CostModel(GPU, MODEL)


def test_decode_step_grows_with_context_and_batch():
    c = cm()
    assert c.decode_step_s(8, 1000, 1) < c.decode_step_s(8, 20_000, 1)
    assert c.decode_step_s(8, 4000, 1) < c.decode_step_s(64, 4000, 1)
    assert c.decode_step_s(0, 4000, 1) == 0.0


def test_tensor_parallel_decodes_faster_but_sublinearly():
    c = cm()
    t1, t2, t4 = (c.decode_step_s(16, 8000, tp) for tp in (1, 2, 4))
    assert t1 > t2 > t4
    assert t1 / t4 < 4.0


def test_batching_raises_throughput():
    c = cm()
    assert 64 / c.decode_step_s(64, 4000, 1) > 8 / c.decode_step_s(8, 4000, 1)


def test_prefill_grows_with_tokens_and_cached_context_and_shrinks_with_tp():
    c = cm()
    assert c.prefill_s(1000, 0, 1) < c.prefill_s(4000, 0, 1)
    assert c.prefill_s(1000, 0, 1) < c.prefill_s(1000, 30_000, 1)
    assert c.prefill_s(8000, 0, 4) < c.prefill_s(8000, 0, 1)
    assert c.prefill_s(0, 100, 1) == 0.0


def test_training_time_scales_with_tokens_and_gpus():
    c = cm()
    assert c.train_step_s(1e6, 8000, 16) < c.train_step_s(2e6, 8000, 16)
    # Doubling the data-parallel GPUs halves compute but not the gradient all-reduce.
    half = c.train_step_s(1e6, 8000, 16) / 2
    assert half < c.train_step_s(1e6, 8000, 32) < 1.1 * half
    assert c.train_step_s(1e6, 8000, 16, tp=4) > c.train_step_s(1e6, 8000, 16, tp=1)
    assert c.train_step_s(1e6, 8000, 0) == float("inf")


def test_kv_capacity_grows_with_tp_and_training_needs_sharded_state():
    c = cm()
    assert 0 < c.kv_capacity_tokens(1) < c.kv_capacity_tokens(4)
    assert c.min_train_gpus() * GPU.mem_bytes * 0.5 >= MODEL.params * c.train_state_bytes_per_param


def test_calibration_recovers_a_constant_factor():
    c = cm()
    samples = [
        Profile("decode", 1.5 * c.decode_step_s(b, ctx, 1), batch=b, context=ctx)
        for b, ctx in ((4, 1000), (32, 8000))
    ] + [Profile("train", 0.5 * c.train_step_s(1e6, 4000, 8), tokens=1_000_000, context=4000, gpus=8)]
    cal = c.calibrate(samples)
    assert cal.decode == pytest.approx(1.5)
    assert cal.train == pytest.approx(0.5)
    assert cal.prefill == 1.0
    with pytest.raises(ValueError):
        c.calibrate([Profile("bogus", 1.0)])


def test_long_sequences_train_at_the_sequence_parallel_degree_they_need():
    c = cm()
    assert c.train_parallel(1, 8000) == 1
    assert c.train_parallel(1, 40_000) == 4  # 40k tokens over 16k per GPU -> SP 3 -> 4
    assert c.train_parallel(8, 40_000) == 8
    assert c.train_step_s(1e6, 8000, 16, max_seq=40_000) > c.train_step_s(1e6, 8000, 16, max_seq=8000)


def test_switch_and_join_costs_include_their_fixed_parts():
    c = cm()
    assert c.colocated_switch_s(48, 4) > c.calib.colocate_fixed_s
    assert c.state_fetch_s(16) > c.calib.join_fixed_s
    assert c.engine_load_s(8) < c.engine_load_s(1)
    # Per decode iteration the engine pays an overhead that TP does not shrink.
    assert c.decode_step_s(1, 100, 8) > c.calib.decode_overhead_s


def test_lending_switch_is_the_colocated_switch_in_wall_time_for_emulated_engines_only() -> None:
    from services.common.cost_model import load_presets
    from services.common.lending import switch_s
    from services.common.runconfig import RunConfig

    def cfg(backend: str, engines: int = 2) -> RunConfig:
        return RunConfig.model_validate(
            {
                "rollout": {"backend": backend, "emulated": {"model": "qwen3-14b", "time_scale": 0.5}},
                "training": {"emulated_gpus": 16},
                "planner": {"lending": {"engines": engines, "tensor_parallel": 8}},
            }
        )

    expected = load_presets("H100", "qwen3-14b").colocated_switch_s(16, 8) * 0.5
    assert switch_s(cfg("emulated")) == pytest.approx(expected) and expected > 1.0
    assert switch_s(cfg("hf")) == 0.0  # real engines pay what the move really costs
    assert switch_s(cfg("emulated", engines=0)) == 0.0
