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


def test_a_trainer_may_speak_for_its_own_engine_and_read_its_turns_but_no_other_engines() -> None:
    """planner.lending.trainer_serves: the trainer `trainer-0` serves lent turns as the worker
    `trainer-0-engine`, which its identity may speak for and take turn requests of; not for any
    other trainer's engine, nor for a rollout engine."""
    from services.common.credentials import Identity, publish_allowed, redis_acl, subscribe_allowed
    from services.common.redis_scope import run_key_patterns

    me = Identity("trainer-0", per_worker=True)
    pub, sub = set(publish_allowed(me)), set(subscribe_allowed(me))
    run = "libra.v1.*."
    spoken = (subjects.TURN_RESULT, subjects.TURN_PROGRESS, subjects.ENGINE_LOAD, subjects.HYBRID_STATE)
    for s in (*spoken, subjects.WORKER_HELLO):
        assert run + subjects.spoken(s, "trainer", "trainer-0-engine") in pub
        assert run + subjects.spoken(s, "trainer", "trainer-1-engine") not in pub
    assert not any(".rollout-engine." in p for p in pub)
    assert run + f"{subjects.TURN_REQUEST}.trainer-0-engine" in sub
    assert not any(
        s.startswith(run + subjects.TURN_REQUEST) and not s.endswith("trainer-0-engine") for s in sub
    )
    assert not any(w.startswith(("~", "%R~")) for w in redis_acl(me, "pw").split())  # keys come per job
    keys = run_key_patterns(me, "r1", [me])
    assert "~libra:r1:lease:worker:trainer-0-engine" in keys and "~libra:r1:lease:worker:trainer-0" in keys
    assert not any("rollout-engine" in k or "trainer-1" in k for k in keys)
    engine = Identity("rollout-engine-0", per_worker=True)
    assert not any("trainer" in p for p in publish_allowed(engine))
