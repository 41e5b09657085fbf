"""Turn requests that carry only what an engine does not hold yet (context deltas).

A trajectory's next turn usually goes back to the engine that served its last one (the router's
pull towards the engine holding the context). That engine already has the turn's context up to
the end of what it generated; the request then carries only the tokens after them (the tool
return and the chat template's glue), not the whole context again, which made a trajectory's
bytes on the bus grow with the square of its turns.

Both sides agree on what is held by a digest: the scheduler sends a delta only when the digest
of the context's first tokens is the one of what the engine was left holding, and sends that
digest along; the engine checks it against what it holds. An engine that lost them (restarted,
evicted them) answers `context_unknown` and the scheduler sends the whole context, without
spending a retry.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import LibraError


class ContextUnknown(LibraError):
    """A context delta for tokens this engine does not hold."""

    code = "context_unknown"


def context_digest(tokens: Sequence[int]) -> int:
    """A 64-bit digest of a token sequence (BLAKE2b of its int32 values)."""
    return int.from_bytes(hashlib.blake2b(array("i", tokens).tobytes(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Held:
    """What the scheduler knows one engine holds of a trajectory: its first `tokens` tokens, whose
    digest is `digest`."""

    engine_id: str
    tokens: int
    digest: int

    @classmethod
    def after(cls, engine_id: str, context: Sequence[int], generated: Sequence[int]) -> Held:
        whole = [*context, *generated]
        return cls(engine_id, len(whole), context_digest(whole))

    def offset_for(self, engine_id: str, context: Sequence[int]) -> int:
        """How many of `context`'s first tokens `engine_id` holds (0: send the whole context):
        the engine must be this one, the context must go on past them, and its first tokens must
        be these (a re-rendered conversation that changed them sends everything). A delta from
        there carries `digest`."""
        if engine_id != self.engine_id or not 0 < self.tokens < len(context):
            return 0
        return self.tokens if context_digest(context[: self.tokens]) == self.digest else 0


class HeldContexts:
    """The engine's side: each trajectory's context after its last turn here, the least recently
    used dropped past `max_tokens` in all (4 bytes a token)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._held: OrderedDict[str, array[int]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def rebuild(self, trajectory_id: str, offset: int, delta: Sequence[int], digest: int) -> list[int]:
        """The whole context of a turn sent as a delta; `ContextUnknown` when this engine does not
        hold the first `offset` tokens the scheduler means (none, fewer, or another digest)."""
        held = self._held.get(trajectory_id)
        if held is None or len(held) < offset:
            have = 0 if held is None else len(held)
            raise ContextUnknown(f"{trajectory_id}: holds {have} of its tokens, the delta starts at {offset}")
        head = held[:offset]
        if context_digest(head) != digest:
            raise ContextUnknown(f"{trajectory_id}: its {offset} tokens held here are not the ones meant")
        self._held.move_to_end(trajectory_id)
        return [*head, *delta]

    def keep(self, trajectory_id: str, tokens: Sequence[int]) -> None:
        """The trajectory's context after a turn here (its context and what was generated)."""
        old = self._held.pop(trajectory_id, None)
        if old is not None:
            self.tokens -= len(old)
        if len(tokens) > self.max_tokens:
            return
        self._held[trajectory_id] = array("i", tokens)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            _, dropped = self._held.popitem(last=False)
            self.tokens -= len(dropped)

    def forget(self, trajectory_id: str) -> None:
        old = self._held.pop(trajectory_id, None)
        if old is not None:
            self.tokens -= len(old)
