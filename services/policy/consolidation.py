"""Which running turns to move, with their KV cache, from busy engines to idle ones.

As a step's trajectories drain, the stragglers sit unevenly: one engine still decodes many long
turns while another has few. A decode step reads the whole batch's KV, so the busy engine's every
token is slower than the idle one's. Moving a running turn *with its KV* (RDMA, no re-prefill:
Seer's divided rollout, arXiv 2511.14617, over a Mooncake-style transfer engine) evens the
batches out; it is worth it only where no queued turn would fill the idle engine anyway, which
the caller checks. Pure: counts in, moves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSlots:
    engine_id: str
    running: int
    max_running: int


def consolidation_moves(
    engines: Sequence[EngineSlots], min_gap: int = 2, max_moves: int = 64
) -> list[tuple[str, str]]:
    """(from, to) engine pairs, one running turn per pair, each from the busiest engine to the
    idlest until their counts differ by less than `min_gap` (at most `max_moves`)."""
    running = {e.engine_id: e.running for e in engines}
    cap = {e.engine_id: e.max_running for e in engines}
    moves: list[tuple[str, str]] = []
    while len(moves) < max_moves and len(running) > 1:
        src = max(running, key=lambda k: (running[k], k))
        dst = min((k for k in running if running[k] < cap[k]), key=lambda k: (running[k], k), default=None)
        if dst is None or running[src] - running[dst] < min_gap:
            break
        moves.append((src, dst))
        running[src] -= 1
        running[dst] += 1
    return moves
