"""Which sibling responses a turn's drafter can read (services/simulation/drafting.py explains the three
drafters), counted as the group's turns finish, and the per-token acceptance that buys."""

from __future__ import annotations

from services.simulation.drafting import AcceptanceModel
from services.simulation.state import Group


class SiblingReach:
    def __init__(self, drafter: str, model: AcceptanceModel):
        self.drafter, self.model = drafter, model

    def acceptance(self, g: Group, turn: int, engine_id: str) -> float:
        """Per-token acceptance of this turn's drafter: what it can read of the group's same turn."""
        if self.drafter == "group":
            siblings = g.turns_done.get(turn, 0)
        elif self.drafter == "suffix":
            siblings = g.turns_done_on.get((engine_id, turn), 0)
        else:
            siblings = 0
        return self.model.acceptance(siblings)

    def turn_done(self, g: Group, turn: int, engine_id: str | None) -> None:
        """A member's `turn` finished on `engine_id`: later siblings' drafters may read it."""
        if self.drafter == "group":
            g.turns_done[turn] = g.turns_done.get(turn, 0) + 1
        elif self.drafter == "suffix" and engine_id is not None:
            key = (engine_id, turn)
            g.turns_done_on[key] = g.turns_done_on.get(key, 0) + 1
