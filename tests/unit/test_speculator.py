"""The live engine's speculation glue (`services/generation/speculator.py`), pure logic: step
times fitted robustly, acceptance estimated from what the verifier did, drafts cut to the room a
row has left and to what pays at the engine's measured step times."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.runconfig import RolloutConfig, SpeculativeConfig
from services.generation.speculator import Acceptance, RealisedRates, Row, Speculator, StepTimes


def test_step_times_are_flat_until_two_sizes_are_measured_and_ignore_a_stalled_step() -> None:
    t = StepTimes()
    assert t(1) == t(100)  # nothing measured: drafts taken as free
    for _ in range(5):
        t.add(4, 0.10)
    assert t(4) == pytest.approx(0.10) and t(40) == pytest.approx(0.10)
    for _ in range(5):
        t.add(12, 0.14)
    t.add(12, 9.0)  # one stall (another process had the cores)
    base, slope = t.line()
    assert slope == pytest.approx(0.005) and base == pytest.approx(0.08)
    t.add(20, 0.01)  # faster at a larger size: noise, never a negative slope
    assert t.line()[1] >= 0.0


def test_acceptance_is_the_geometric_estimate_with_a_prior() -> None:
    a = Acceptance(decay=1.0)
    assert a.rate == 0.5
    a.observe(drafted=4, accepted=4)  # all accepted: no rejection seen
    a.observe(drafted=4, accepted=2)  # two, then a rejection
    assert a.rate == pytest.approx(round((1 + 6) / (1 + 6 + 1 + 1), 2))


def rows(n: int, room: int = 50) -> list[Row]:
    context = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # its own context repeats: prompt lookup finds 4, 5, 6, 1, ...
    return [Row(i, "p", "g", context, room) for i in range(n)]


def test_drafts_respect_the_room_left_and_num_tokens() -> None:
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=3, policy="fixed"))
    out = spec.drafts(rows(2) + [Row(9, "p", "g", rows(1)[0].context, room=2), Row(8, "p", "g", [7], 9)])
    assert out == {0: [4, 5, 6], 1: [4, 5, 6], 9: [4]}  # room 2: one drafted token and one more
    spec.verified(0, 3, 2)  # one accepted, then a token of its own
    spec.verified(1, 3, 4)
    c = spec.counters
    assert (c.verify_steps, c.drafted, c.accepted) == (2, 6, 4) and c.by_source["self"] == [6, 4]


def test_adaptive_policy_drafts_when_verifying_is_cheap_and_not_when_it_costs_more_than_it_saves() -> None:
    cheap = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for q in (8, 16, 24, 40):
        cheap.stepped(q, 0.05)  # memory-bound: the same time at any size
    assert len(cheap.drafts(rows(8))) == 8
    costly = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for q in (8, 16, 24, 40):
        costly.stepped(q, 0.01 * q)  # compute-bound: time grows with every query token
    costly.acceptance["self"] = Acceptance(accepted=1.0, rejected=9.0)  # drafts mostly rejected
    assert costly.drafts(rows(8)) == {}


def test_drafting_is_held_off_where_drafting_steps_emitted_fewer_tokens_per_second() -> None:
    r = RealisedRates(min_samples=4, explore_every=4, min_plain=2)
    for _ in range(4):
        r.add(8, False, 8, 0.10)  # 80 tokens/s plain at 8 rows
        r.add(8, True, 10, 0.15)  # 67 tokens/s drafting: the fit priced it wrong
        r.add(2, False, 2, 0.05)  # 40 tokens/s plain at 2 rows
        r.add(2, True, 3, 0.06)  # 50 tokens/s drafting: it pays
    assert r.gains(8) == pytest.approx([10 * 0.10 / (8 * 0.15)] * 4)
    assert r.pays(2) and not r.pays(8) and r.pays(4)  # 3-4 rows: no evidence yet
    assert not r.pays(6) and r.pays(9)  # 5-8 rows pooled; 9-16 rows: no evidence
    assert [RealisedRates.size(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [r.allows(8) for _ in range(8)] == [False, False, False, True] * 2  # every 4th explores
    assert all(r.allows(2) for _ in range(5))
    for _ in range(4):
        r.add(8, True, 16, 0.15)  # the exploring steps now do better: drafting resumes
    assert r.pays(8) and r.allows(8)

    # pooled sizes compare each drafting step with plain steps of its own row count: drafting at 5
    # rows against plain at 5 rows loses, though it beats plain steps at 8 rows per second
    pooled = RealisedRates(min_samples=4, min_plain=2)
    for _ in range(4):
        pooled.add(8, False, 8, 0.10)  # 80 tokens/s
        pooled.add(5, False, 5, 0.05)  # 100 tokens/s
        pooled.add(5, True, 6, 0.07)  # 86 tokens/s: more than 8 rows plain, less than 5 rows plain
    assert not pooled.pays(8)
    # a drafting step whose row count has no plain steps yet is not counted
    assert RealisedRates(min_plain=2).gains(8) == []

    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for _ in range(8):
        spec.stepped(8, 0.10, rows=8, emitted=8)
        spec.stepped(16, 0.15, rows=8, emitted=10)
    assert spec.drafts(rows(8)) == {} and len(spec.drafts(rows(2))) == 2
    assert spec.counters.held_steps == 1 and spec.counters.values()["spec_held_steps"] == 1.0
    # new plain steps change what a drafting step is compared with (the medians are recomputed)
    for _ in range(40):
        spec.stepped(8, 0.20, rows=8, emitted=8)  # plain steps got slower: 40 tokens/s
    assert spec.realised.gains(8)[0] == pytest.approx(10 * 0.20 / (8 * 0.15))
    fixed = Speculator(SpeculativeConfig(method="ngram", num_tokens=4, policy="fixed"))
    for _ in range(8):
        fixed.stepped(8, 0.10, rows=8, emitted=8)
        fixed.stepped(16, 0.15, rows=8, emitted=10)
    assert len(fixed.drafts(rows(8))) == 8  # fixed verifies every draft it finds


def test_suffix_learns_finished_responses_and_ngram_does_not() -> None:
    suffix = Speculator(SpeculativeConfig(method="suffix"))
    suffix.finished("p", "g", [10, 11, 12, 13, 14, 15])
    assert suffix.drafts([Row(0, "p", "g", [9, 10, 11, 12], 20)]) == {0: [13, 14, 15]}
    ngram = Speculator(SpeculativeConfig(method="ngram"))
    ngram.finished("p", "g", [10, 11, 12, 13, 14, 15])
    assert len(ngram.drafter) == 0 and ngram.drafts([Row(0, "p", "g", [9, 10, 11, 12], 20)]) == {}


def test_speculation_needs_a_backend_that_generates() -> None:
    with pytest.raises(ValidationError, match="rollout.speculative needs a backend that generates"):
        RolloutConfig(backend="emulated", speculative=SpeculativeConfig(method="suffix"))
    with pytest.raises(ValueError, match="off"):
        Speculator(SpeculativeConfig())


def test_vllm_gets_the_method_and_draft_length_or_nothing() -> None:
    from services.generation.backends.vllm import vllm_speculative_config

    assert vllm_speculative_config(SpeculativeConfig()) is None
    cfg = vllm_speculative_config(SpeculativeConfig(method="suffix", num_tokens=8))
    assert cfg == {"method": "suffix", "num_speculative_tokens": 8}
    ngram = vllm_speculative_config(SpeculativeConfig(method="ngram", num_tokens=3))
    assert ngram is not None and ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 3


def test_padded_width_drafts_at_the_tail_and_not_where_padding_costs_the_whole_batch() -> None:
    from services.policy.speculation import SpeculationPolicy

    policy = SpeculationPolicy(mode="adaptive", draft_tokens=6)

    def affine(q: int) -> float:  # a step's fixed cost dominates: memory-bound, as at the tail
        return 0.05 + 0.001 * q

    assert policy.padded_width([(0.9, 6)], rows=1, step_s=affine) == 6
    assert policy.padded_width([(0.9, 2)], rows=1, step_s=affine) == 2  # longer is only padding

    def linear(q: int) -> float:  # every query token costs the same: compute-bound
        return 0.01 * q

    # one good draft would widen all 8 rows' forward: not worth it
    assert policy.padded_width([(0.9, 6)], rows=8, step_s=linear) == 0
    assert policy.padded_width([], rows=8, step_s=affine) == 0
    assert SpeculationPolicy(mode="fixed", draft_tokens=3).padded_width([(0.1, 6)], 8, linear) == 3
