"""The calculator agent (`calculator_agent.py`) asking for two choices per call (`n=2`) and going
on from the first that is a well-formed action (a `<calc>` call or an `<answer>`), else the first.

Libra samples the call's choices as one turn and its alternative beside it; the choice this agent
sends back is the one trained, exactly as sampled (`docs/tasks.md`, "A call with `n` > 1"). Run it
with `libra run configs/openai_agent.yaml --task.agent best_of_n_agent:agent`.
"""

from __future__ import annotations

from typing import Any

import openai
from calculator_agent import solve


def well_formed(texts: list[str]) -> str:
    """The first choice that is an action (a `<calc>` call or an `<answer>`), else the first."""
    return next((t for t in texts if "<answer>" in t or "<calc>" in t), texts[0])


async def agent(sample: dict[str, Any], base_url: str, api_key: str) -> float:
    return await solve(openai.AsyncOpenAI(base_url=base_url, api_key=api_key), sample, n=2, pick=well_formed)
