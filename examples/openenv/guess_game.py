"""An environment written against OpenEnv's own API (`openenv.core`), trained by Libra unchanged
(`configs/openenv_example.yaml`): guess a number from 1 to 20, answered "higher" or "lower".

Libra runs it in its environment workers (`task.environment_args: {env: guess_game:GuessNumber}`),
or, served as OpenEnv serves environments (`uvicorn guess_game:app --port 8000`, in this
directory), over OpenEnv's WebSocket sessions (`{url: http://127.0.0.1:8000}`). See docs/tasks.md.
"""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class Guess(Action):
    message: str


class Said(Observation):
    text: str = ""


class GuessState(State):
    secret: int = 0


class GuessNumber(Environment[Guess, Said, GuessState]):
    """Guess a number from 1 to 20 (seeded by `reset`): 1.0 when right; -0.1 for a turn without a
    number; "higher" or "lower" otherwise, until the turns run out."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, turns: int = 6):
        super().__init__()
        self.turns, self._state = turns, GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Said:
        self._state = GuessState(step_count=0, secret=random.Random(seed).randint(1, 20))
        return Said(text=f"Guess my number from 1 to 20 in {self.turns} turns.", reward=0.0)

    def step(self, action: Guess, timeout_s: float | None = None, **kw: Any) -> Said:
        self._state.step_count += 1
        out_of_turns = self._state.step_count >= self.turns
        digits = "".join(c for c in action.message if c.isdigit())
        if not digits:
            return Said(text="No number there.", reward=-0.1, done=out_of_turns)
        guess = int(digits)
        if guess == self._state.secret:
            return Said(text="Right!", reward=1.0, done=True)
        hint = "higher" if guess < self._state.secret else "lower"
        return Said(text=f"{guess}: {hint}.", reward=0.0, done=out_of_turns)

    @property
    def state(self) -> GuessState:
        return self._state


app = create_fastapi_app(GuessNumber, Guess, Said, state_cls=GuessState, max_concurrent_envs=64)
