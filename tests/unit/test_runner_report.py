"""The job report counts each train step once, however the trainer announced the end."""

from services.common.contracts import ev
from tools.runner import per_step


def _m(step: int, done: bool = False, reward: float = 0.0) -> ev.TrainMetrics:
    return ev.TrainMetrics(step=step, weight_version=step, reward_mean=reward, done=done)


def test_done_on_the_last_step_counts_that_step() -> None:
    steps = per_step([_m(1, reward=0.1), _m(2, done=True, reward=0.2)])
    assert [m.step for m in steps] == [1, 2]
    assert [m.reward_mean for m in steps] == [0.1, 0.2]


def test_separate_done_message_is_not_a_new_step() -> None:
    steps = per_step([_m(1), _m(2, reward=0.5), _m(2, done=True, reward=0.5)])
    assert [m.step for m in steps] == [1, 2]


def test_out_of_order_and_step_zero() -> None:
    assert [m.step for m in per_step([_m(2), _m(0, done=True), _m(1)])] == [1, 2]


def test_steps_past_the_committed_one_are_not_reported() -> None:
    """A forged metrics message for a step the trainer never committed is not a step of the report."""
    steps = per_step([_m(1), _m(2), _m(9, done=True, reward=1.0)], committed_step=2)
    assert [m.step for m in steps] == [1, 2]
