"""Engines out of routing for their invalid turn results (pure)."""

from __future__ import annotations

from services.policy.quarantine import Quarantine


def test_an_engine_goes_out_after_its_invalid_results_in_a_row_while_another_serves() -> None:
    q = Quarantine(max_in_a_row=3)
    assert not q.invalid_result("e1", 7, others_serve=True)
    assert not q.invalid_result("e1", 7, others_serve=True)
    q.valid("e1")  # a valid one in between: the streak starts again
    assert not q.invalid_result("e1", 7, True) and not q.invalid_result("e1", 7, True)
    assert q.invalid_result("e1", 7, True) and q.invalid["e1"] == 5
    q.take_out("e1", 7)
    assert not q.invalid_result("e1", 7, True), "already out"
    assert not q.serves("e1", 7) and q.serves("e1", 8), "back under a new fencing token"
    assert q.serves("e2", 1)


def test_the_last_engine_serving_and_one_outside_the_plan_stay() -> None:
    q = Quarantine(max_in_a_row=1)
    assert not q.invalid_result("e1", 7, others_serve=False)
    assert not q.invalid_result("e2", None, others_serve=True)
    assert q.invalid == {"e1": 1, "e2": 1} and not q.out
