"""A multi-turn environment of your own (`task.environment: guess_env:GuessNumber`): the model
guesses a secret number and the environment answers "higher" or "lower" until it is found.

Not a "call one tool" task: the environment itself answers every turn. One instance plays one
trajectory; see docs/tasks.md for the interface (reset / step / optional tool_result)."""

from __future__ import annotations

import re
from typing import Any

_GUESS = re.compile(r"<guess>\s*(-?\d+)")

RULES = (
    "Let's play a game. I am thinking of a whole number between {low} and {high}. Guess it by "
    "writing <guess>NUMBER</guess>; I will answer Higher or Lower. Find it in as few guesses as "
    "you can: halve the range each time."
)


class GuessNumber:
    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.secret = int(sample["answer"])
        self.low, self.high = int(sample.get("low", 1)), int(sample.get("high", 100))
        self.guesses = 0
        rules = RULES.format(low=self.low, high=self.high)
        return [  # one worked game, then ours
            {"role": "user", "content": RULES.format(low=1, high=8)},
            {"role": "assistant", "content": "<guess>4</guess>"},
            {"role": "user", "content": "Higher."},
            {"role": "assistant", "content": "<guess>6</guess>"},
            {"role": "user", "content": "Lower."},
            {"role": "assistant", "content": "<guess>5</guess>"},
            {"role": "user", "content": "Correct!"},
            {"role": "user", "content": rules},
        ]

    def step(self, response: str) -> dict[str, Any]:
        match = _GUESS.search(response)
        if match is None:
            return {"observation": "Write your guess as <guess>NUMBER</guess>."}
        self.guesses += 1
        guess = int(match.group(1))
        if guess == self.secret:  # 1 for a first-guess hit, less for each extra guess
            return {"done": True, "reward": 1.0 / self.guesses}
        if not self.low <= guess <= self.high:
            return {"observation": f"{guess} is outside {self.low}..{self.high}."}
        return {"observation": "Higher." if guess < self.secret else "Lower."}
