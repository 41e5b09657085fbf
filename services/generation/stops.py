"""Stop-string checks on generated tokens (no torch: the engine loop imports it for every backend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopMatcher:
    """Finds a stop string in the tail of generated text without re-decoding the whole output.

    A stop string of n characters is completed by at most the last n tokens (every token decodes to
    at least one character), so decoding the last `max(len(stop)) + 1` tokens is enough.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.window = max((len(s) for s in self.stops), default=0) + 1

    def matches(self, generated: list[int]) -> bool:
        if not self.stops:
            return False
        tail = self.decode(generated[-self.window :])
        return any(s in tail for s in self.stops)
