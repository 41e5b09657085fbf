"""Which engines are taken out of routing for their invalid turn results (pure).

A turn result that fails the scheduler's checks (tokens outside the vocabulary, bad logprobs,
versions the trainer never made, more tokens than asked) changes nothing and is retried on
another engine. An engine that sends `max_in_a_row` such results in a row, while another engine
serves, is out of routing for the rest of its lease: a broken or compromised engine must not
keep failing turns. The last engine serving is kept (its turns fail typed rather than wait for
no engine). It comes back only under a new fencing token (restarted, leased again).
"""

from __future__ import annotations

from collections import Counter


class Quarantine:
    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.invalid: Counter[str] = Counter()
        """Engine id -> its invalid turn results so far."""
        self._streak: Counter[str] = Counter()
        """Engine id -> its invalid results since its last valid one."""
        self.out: dict[str, int] = {}
        """Engines out of routing -> the fencing token they had then."""

    def valid(self, engine_id: str) -> None:
        self._streak.pop(engine_id, None)

    def invalid_result(self, engine_id: str, token: int | None, others_serve: bool) -> bool:
        """Counts an invalid result from `engine_id` (under fencing `token`, None: not in the plan);
        True when it is to go out of routing now."""
        self.invalid[engine_id] += 1
        self._streak[engine_id] += 1
        return (
            self._streak[engine_id] >= self.max_in_a_row
            and engine_id not in self.out
            and token is not None
            and others_serve
        )

    def take_out(self, engine_id: str, token: int) -> None:
        self.out[engine_id] = token

    def serves(self, engine_id: str, token: int) -> bool:
        """Whether the engine under this fencing token may be routed to."""
        return self.out.get(engine_id) != token
