"""A message on a worker's own subject may name only that worker as its sender."""

from __future__ import annotations

import pytest

from services.common import subjects
from services.common.bus import said_by
from services.common.contracts import ev
from services.common.errors import ForgedSender

HELLO = "libra.v1.r1." + subjects.spoken(subjects.WORKER_HELLO, "rollout-engine", "rollout-engine-1")


def test_its_own_name_passes_and_an_empty_one_is_filled_in() -> None:
    said_by(HELLO, ev.WorkerHello(worker_id="rollout-engine-1", kind="rollout-engine"))
    anonymous = ev.WorkerHello(weight_sync_addr="h:1")
    said_by(HELLO, anonymous)
    assert (anonymous.worker_id, anonymous.kind) == ("rollout-engine-1", "rollout-engine")
    result = ev.TurnResult(request_id="q")
    said_by("libra.v1.r1." + subjects.spoken(subjects.TURN_RESULT, "rollout-engine", "e7"), result)
    assert result.engine_id == "e7"


@pytest.mark.parametrize(
    "msg",
    [
        ev.WorkerHello(worker_id="rollout-engine-0", kind="rollout-engine"),
        ev.WorkerHello(worker_id="rollout-engine-1", kind="trainer"),
        ev.WorkerStatus(worker_id="trainer", service="trainer", state="failed"),
    ],
)
def test_another_name_is_forged(msg: object) -> None:
    with pytest.raises(ForgedSender):
        said_by(HELLO, msg)  # type: ignore[arg-type]


def test_only_the_trainer_speaks_of_another_worker_and_only_to_refuse_its_join() -> None:
    on = "libra.v1.r1." + subjects.spoken(subjects.HYBRID_STATE, "trainer", "trainer")
    said_by(on, ev.HybridState(worker_id="rollout-engine-0", state="refused"))
    with pytest.raises(ForgedSender):
        said_by(on, ev.HybridState(worker_id="rollout-engine-0", state="ready"))
    engine = "libra.v1.r1." + subjects.spoken(subjects.HYBRID_STATE, "rollout-engine", "rollout-engine-1")
    with pytest.raises(ForgedSender):
        said_by(engine, ev.HybridState(worker_id="rollout-engine-0", state="refused"))
