"""Context deltas (pure): what the scheduler sends against what an engine holds, and the engine's
bounded store of held contexts."""

from __future__ import annotations

import pytest

from services.common.held_context import ContextUnknown, Held, HeldContexts, context_digest


def test_a_delta_is_sent_only_to_the_engine_holding_the_contexts_first_tokens() -> None:
    held = Held.after("e1", [1, 2, 3], [4, 5])
    assert (held.tokens, held.digest) == (5, context_digest([1, 2, 3, 4, 5]))
    assert held.offset_for("e1", [1, 2, 3, 4, 5, 9, 9]) == 5
    assert held.offset_for("e2", [1, 2, 3, 4, 5, 9, 9]) == 0, "another engine holds nothing"
    assert held.offset_for("e1", [1, 2, 3, 4, 5]) == 0, "nothing new: the whole context"
    assert held.offset_for("e1", [1, 2, 3, 4, 6, 9]) == 0, "a re-rendered context: the whole of it"
    assert context_digest([1, 2]) != context_digest([2, 1]) and context_digest([]) == context_digest([])


def test_the_engine_rebuilds_a_delta_from_what_it_holds_and_refuses_what_it_does_not() -> None:
    store = HeldContexts(max_tokens=100)
    store.keep("t", [1, 2, 3, 4, 5])
    assert store.rebuild("t", 5, [9], context_digest([1, 2, 3, 4, 5])) == [1, 2, 3, 4, 5, 9]
    assert store.rebuild("t", 3, [7], context_digest([1, 2, 3])) == [1, 2, 3, 7], "a prefix of it"
    for traj, offset, digest in (("u", 1, context_digest([1])), ("t", 6, 0), ("t", 5, context_digest([5]))):
        with pytest.raises(ContextUnknown) as err:
            store.rebuild(traj, offset, [9], digest)
        assert err.value.code == "context_unknown"
    store.forget("t")
    assert len(store) == 0 and store.tokens == 0


def test_held_contexts_stay_within_their_token_budget_least_recently_used_first() -> None:
    store = HeldContexts(max_tokens=10)
    store.keep("a", [1] * 4)
    store.keep("b", [2] * 4)
    store.rebuild("a", 4, [0], context_digest([1] * 4))  # used: b is now the oldest
    store.keep("c", [3] * 4)
    assert store.tokens == 8 and len(store) == 2
    with pytest.raises(ContextUnknown):
        store.rebuild("b", 4, [0], context_digest([2] * 4))
    store.keep("a", [1] * 6)  # its next turn replaces it
    assert store.tokens == 10 and len(store) == 2
    store.keep("huge", [4] * 11)  # more than the whole budget: not kept, nothing dropped for it
    assert store.tokens == 10 and len(store) == 2
    off = HeldContexts(max_tokens=0)  # keeps none: every delta goes again whole
    off.keep("a", [1])
    assert len(off) == 0
