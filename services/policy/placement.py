"""Engines indexed by load, so that placing a turn costs O(log n) in the engines of its bucket,
not a scan of them.

Every routing policy that places by load (C-MLFQ and the least-connections baselines) picks the
engine with the lowest `running / slots` among those with a free slot, less a bonus for the one
engine that holds the trajectory's context, the first in engine order on a tie. That choice is
always one of two engines: the least loaded one that can take the turn, or the one holding the
context. So the placement asks the policy to choose between those two (`candidates`), found
through a heap, and the policy's choice is the one a scan of every engine would make.

Pure: no I/O; the scheduler's dispatcher and the simulator keep one index per bucket.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class LoadIndex:
    """The engines with a free slot, least loaded first (ties: the lower `order`).

    A heap with lazy deletion: a change pushes the engine's new entry, O(log n); an entry the
    engine has since replaced is dropped when it surfaces, and the heap is rebuilt when such
    entries outnumber the live ones. `least` is O(log n), plus O(log n) for each engine it passes
    over (one whose KV cache does not hold the turn, or the engine the turn avoids)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str]] = []
        """(load, order, stamp, engine id); an entry is live while its stamp is the engine's."""
        self._live: dict[str, tuple[float, int, int, str]] = {}
        self._stamp = 0

    def __len__(self) -> int:
        """Engines with a free slot."""
        return len(self._live)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._live

    def set(self, engine_id: str, order: int, running: int, capacity: int) -> None:
        """The engine's load now; an engine without a free slot leaves the index until it has one."""
        if running >= capacity:
            self.remove(engine_id)
            return
        self._stamp += 1
        entry = (running / capacity, order, self._stamp, engine_id)
        self._live[engine_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def remove(self, engine_id: str) -> None:
        self._live.pop(engine_id, None)

    def engines(self) -> list[str]:
        """Every engine with a free slot (no order)."""
        return list(self._live)

    def least(self, takes: Callable[[str], bool]) -> str | None:
        """The least loaded engine with a free slot that `takes` the turn, or None."""
        passed: list[tuple[float, int, int, str]] = []
        found = None
        heap = self._heap
        while heap:
            entry = heap[0]
            if self._live.get(entry[3]) is not entry:
                heapq.heappop(heap)  # replaced since
                continue
            if takes(entry[3]):
                found = entry[3]
                break
            passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found


def candidates(least: str | None, holder: str | None, order: Callable[[str], int]) -> list[str]:
    """The engines a load-placing policy chooses between — the least loaded that takes the turn
    and the one holding the trajectory's context (when it may serve it) — in engine order, as a
    scan would meet them."""
    if holder is None or holder == least:
        return [] if least is None else [least]
    if least is None:
        return [holder]
    return [least, holder] if order(least) < order(holder) else [holder, least]


def pick(
    index: LoadIndex,
    takes: Callable[[str], bool],
    holder: str | None,
    may_hold: Callable[[str], bool],
    order: Callable[[str], int],
) -> list[str]:
    """The engines a load-placing policy is shown for one turn (`candidates`): the least loaded
    engine of `index` that `takes` the turn, and `holder` (the engine holding its context) while
    it `may_hold` it — serves the turn's bucket and is not one to avoid."""
    if holder is not None and not may_hold(holder):
        holder = None
    return candidates(index.least(takes), holder, order)
