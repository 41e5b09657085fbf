import math

import pytest

from services.common.cost_model import Calibration, load_presets
from services.common.synthetic import Workload
from services.policy.speculation import (
    Lane,
    SpeculationPolicy,
    acceptance_for,
    expected_tokens,
)
from services.simulation.drafting import SEER_DRAFT, SEER_TABLE2, AcceptanceModel
from services.simulation.engine import Engine, Request
from services.simulation.simulator import Simulator
from tools.sim.systems import Env, baseline_system


@pytest.fixture(scope="module")
def cm():
    return load_presets("A800", "qwen3-14b")


def test_expected_tokens_is_leviathans_formula_and_inverts():
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    for alpha in (0.1, 0.4, 0.7, 0.95):
        for k in (1, 4, 8):
            assert acceptance_for(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-9)
    assert acceptance_for(1.0, 8) == 0.0 and acceptance_for(9.0, 8) == 1.0


def test_acceptance_model_reproduces_seers_table_and_scales():
    m = AcceptanceModel()
    for n, tokens in SEER_TABLE2:
        assert m.tokens_per_step(n) == pytest.approx(tokens)
        assert expected_tokens(m.acceptance(n), SEER_DRAFT) == pytest.approx(tokens, abs=2e-3)
    assert [m.acceptance(n) for n in range(8)] == sorted(m.acceptance(n) for n in range(8))
    assert m.tokens_per_step(64) == pytest.approx(SEER_TABLE2[-1][1])  # no extrapolation
    assert AcceptanceModel(0.0).acceptance(7) == 0.0
    half = AcceptanceModel(0.5).tokens_per_step(5)
    assert half == pytest.approx(1 + 0.5 * (2.32 - 1))
    with pytest.raises(ValueError):
        AcceptanceModel(-1.0)


def test_verify_cost_prices_query_tokens_like_verify_step(cm):
    for tp in (1, 8):
        for batch, ctx in ((1, 500), (64, 8000), (256, 30000)):
            cost = cm.verify_cost(batch, ctx, tp)
            for q in (batch, batch * 3, batch * 9):
                assert cost(q) == pytest.approx(cm.verify_step_s(batch, ctx, tp, q), rel=1e-12)
            assert cm.decode_step_s(batch, ctx, tp) == cm.verify_step_s(batch, ctx, tp, batch)
    # Long contexts at small batch are memory-bound: eight more query tokens per sequence cost
    # only their share of the all-reduce.
    assert cm.verify_step_s(4, 20000, 8, 36) < 1.05 * cm.verify_step_s(4, 20000, 8, 4)
    # Short contexts at a large batch are compute-bound: they are not.
    assert cm.verify_step_s(256, 200, 1, 256 * 9) > 2 * cm.verify_step_s(256, 200, 1, 256)


def test_activation_recompute_costs_one_more_forward(cm):
    plain = load_presets("A800", "qwen3-14b")
    plain.calib = Calibration(activation_recompute=False)
    assert cm.train_flops(1e6, 4000) == pytest.approx(1.25 * plain.train_flops(1e6, 4000))


def test_policy_drafts_everything_while_memory_bound_and_nothing_when_compute_bound():
    policy = SpeculationPolicy("adaptive", 8)
    lanes = [Lane(4, 0.6), Lane(2, 0.0)]
    assert policy.drafts(lanes, lambda q: 0.02) == [8, 0]
    # Every query token costs as much as the whole plain step: drafting never pays.
    assert policy.drafts(lanes, lambda q: 0.01 * q) == [0, 0]
    assert SpeculationPolicy("fixed", 4).drafts(lanes, lambda q: 0.01 * q) == [4, 0]
    assert SpeculationPolicy("off", 4).drafts(lanes, lambda q: 0.02) == [0, 0]
    with pytest.raises(ValueError):
        SpeculationPolicy("sometimes")


def test_policy_gives_likelier_drafts_more_tokens_and_maximises_the_rate():
    policy = SpeculationPolicy("adaptive", 8)
    lanes = [Lane(40, 0.8), Lane(40, 0.3)]

    def step(q: int) -> float:  # memory-bound up to 200 query tokens, then compute-bound
        return 0.01 + 1e-4 * max(200, q)

    ks = policy.drafts(lanes, step)
    assert ks[0] > ks[1]

    def rate(k: list[int]) -> float:
        made = sum(ln.sequences * expected_tokens(ln.acceptance, kk) for ln, kk in zip(lanes, k, strict=True))
        return made / step(sum(ln.sequences * (kk + 1) for ln, kk in zip(lanes, k, strict=True)))

    best = max(rate([a, b]) for a in range(9) for b in range(9))
    assert rate(ks) >= 0.98 * best  # the threshold family is within 2 % of brute force here
    theta = policy.threshold(lanes, step)
    joiner = policy.draft_length(0.8, theta)
    assert joiner == ks[0] and policy.draft_length(0.0, theta) == 0


def test_speculating_engine_emits_every_token_and_verifies_at_most_k_plus_one_per_step(cm):
    plain = Engine("e0", "all", 8, cm, max_seqs=16)
    spec = Engine("e1", "all", 8, cm, max_seqs=16, spec=SpeculationPolicy("fixed", 4))
    reqs = [(f"t{i}", 300 + 97 * i, 12000, 0.0 if i == 0 else 0.55) for i in range(6)]
    ends = {}
    for e in (plain, spec):
        e.open(0.0)
        for tid, tokens, ctx, acc in reqs:
            e.join(Request(tid, tokens, ctx, acceptance=acc), 0.0, 1, "p")
        done: dict[str, float] = {}
        while e.n:
            t = e.next_event()
            assert t is not None
            for r in e.pop_done(t):
                done[r.traj_id] = t
                assert r.tokens == next(x[1] for x in reqs if x[0] == r.traj_id)  # lengths unchanged
        ends[e.engine_id] = done
        assert e.kv_used == 0 and e.prefix.tokens == sum(x[1] + x[2] for x in reqs)
    assert set(ends["e0"]) == set(ends["e1"])
    # The sequence without a draft is no faster; the drafted ones finish sooner (memory-bound).
    assert all(ends["e1"][t] < ends["e0"][t] for t in ends["e0"] if t != "t0")
    assert 0 < spec.accepted <= spec.drafted
    tokens = sum(x[1] for x in reqs)
    drafted_tokens = sum(x[1] for x in reqs[1:])
    # Emitted = verify steps + accepted drafts; at most k + 1 tokens per sequence per step.
    assert spec.seq_iters + spec.accepted == pytest.approx(tokens, rel=1e-6)
    assert spec.seq_iters >= tokens / 5
    assert spec.drafted <= 4 * spec.seq_iters + 1e-6
    assert plain.drafted == 0 and plain.seq_iters == pytest.approx(tokens, rel=1e-6)
    assert drafted_tokens / spec.seq_iters > 0


def test_group_drafter_reads_more_siblings_than_a_per_engine_suffix_cache():
    wl = Workload.load("r2e_gym")
    cm = load_presets("A800", "qwen3-14b")
    env = Env(cm, wl.with_overrides(cm.model.max_context, prompts_per_step=4, group_size=4), 16)
    seen = {}
    for drafter in ("suffix", "group", "ngram"):
        system = baseline_system(
            env, "areal-sd", 8, 2, drafter="suffix", speculation=SpeculationPolicy("fixed", 4)
        )
        system.drafter = drafter  # the same system, reading what each drafter can read
        sim = Simulator(system, env.workload, cm, 16, 3, seed=1)
        accs: list[float] = []
        orig = sim.acceptance

        def record(tr, e, orig=orig, accs=accs):
            a = orig(tr, e)
            accs.append(a)
            return a

        sim.acceptance = record  # type: ignore[method-assign]
        sim.run()
        seen[drafter] = sum(accs) / len(accs)
    assert seen["ngram"] < seen["suffix"] < seen["group"]
    assert math.isclose(seen["ngram"], AcceptanceModel().acceptance(0))
