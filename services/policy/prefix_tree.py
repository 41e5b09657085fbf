"""Causal prefix tree: predicts a trajectory's remaining output tokens from its tool-return history.

Each node is a prefix of tool-return states (tool type, payload size class, status). Finished
trajectories teach every node on their path how many output tokens were still to come when that
prefix was reached; nodes keep a sliding window so the estimate follows the policy as it drifts.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.signals import (
    SIZE_CLASSES,
    STATUSES,
    ToolSignal,
    map_sandbox_status,
    size_class,
)

__all__ = [
    "SIZE_CLASSES",
    "STATUSES",
    "CausalPrefixTree",
    "Estimate",
    "PrefixForest",
    "ToolSignal",
    "WindowStats",
    "map_sandbox_status",
    "size_class",
]


class WindowStats:
    """Mean and P90 over the last `window` samples; P90 is cached until the next sample."""

    __slots__ = ("_p90", "_sum", "samples")

    def __init__(self, window: int = 64, samples: Iterable[float] = ()) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._p90: float | None = None
        for s in samples:
            self.add(s)

    def add(self, value: float) -> None:
        if len(self.samples) == self.samples.maxlen:
            self._sum -= self.samples[0]
        self.samples.append(value)
        self._sum += value
        self._p90 = None

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def mean(self) -> float:
        return self._sum / len(self.samples) if self.samples else 0.0

    @property
    def p90(self) -> float:
        if self._p90 is None:
            if not self.samples:
                return 0.0
            ordered = sorted(self.samples)
            self._p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return self._p90


@dataclass(frozen=True, slots=True)
class Estimate:
    """Remaining output tokens predicted at a tree node; `depth` is how much history matched."""

    mean: float
    p90: float
    count: int
    depth: int
    source: str = "global"


class _Node:
    __slots__ = ("children", "stats")

    def __init__(self, window: int) -> None:
        self.children: dict[str, _Node] = {}
        self.stats = WindowStats(window)


class CausalPrefixTree:
    """A tree of tool-return prefixes with sliding-window remaining-token statistics per node."""

    def __init__(self, window: int = 64, max_depth: int = 16) -> None:
        self.window = window
        self.max_depth = max_depth
        self.root = _Node(window)

    def observe(self, path: Sequence[ToolSignal], tokens_at: Sequence[int], total_tokens: int) -> None:
        """Teach the tree one finished trajectory.

        `tokens_at[i]` is the output tokens generated when tool return `path[i]` arrived; the root
        learns the whole length, node i learns `total_tokens - tokens_at[i]`.
        """
        node = self.root
        node.stats.add(float(total_tokens))
        for depth, (sig, done) in enumerate(zip(path, tokens_at, strict=True)):
            if depth >= self.max_depth:
                break
            child = node.children.get(sig.key)
            if child is None:
                child = node.children[sig.key] = _Node(self.window)
            child.stats.add(float(max(0, total_tokens - done)))
            node = child

    def estimate(self, path: Sequence[ToolSignal], min_count: int = 8) -> Estimate | None:
        """The deepest node on `path` with at least `min_count` samples, or None."""
        node = self.root
        best = (
            Estimate(node.stats.mean, node.stats.p90, node.stats.count, 0)
            if node.stats.count >= min_count
            else None
        )
        for depth, sig in enumerate(path[: self.max_depth], start=1):
            node = node.children.get(sig.key)  # type: ignore[assignment]
            if node is None or node.stats.count < min_count:
                break
            best = Estimate(node.stats.mean, node.stats.p90, node.stats.count, depth)
        return best

    def node_count(self) -> int:
        stack, n = [self.root], 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n

    def to_dict(self) -> dict[str, Any]:
        def dump(node: _Node) -> dict[str, Any]:
            return {"s": list(node.stats.samples), "c": {k: dump(v) for k, v in node.children.items()}}

        return {"window": self.window, "max_depth": self.max_depth, "root": dump(self.root)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CausalPrefixTree:
        tree = cls(window=int(data["window"]), max_depth=int(data["max_depth"]))

        def load(raw: dict[str, Any]) -> _Node:
            node = _Node(tree.window)
            for s in raw["s"]:
                node.stats.add(float(s))
            node.children = {k: load(v) for k, v in raw["c"].items()}
            return node

        tree.root = load(data["root"])
        return tree


class PrefixForest:
    """Per-prompt trees backed by one global tree.

    GRPO samples a prompt many times, so siblings that finish first teach the others; a prompt
    tree answers only when it matched at least as much history as the global tree would.
    Prompt trees are kept for the `max_prompts` most recently used prompts.
    """

    def __init__(
        self, window: int = 64, max_depth: int = 16, max_prompts: int = 4096, prompt_min_count: int = 3
    ) -> None:
        self.window = window
        self.max_depth = max_depth
        self.max_prompts = max_prompts
        self.prompt_min_count = prompt_min_count
        self.global_tree = CausalPrefixTree(window, max_depth)
        self.prompts: OrderedDict[str, CausalPrefixTree] = OrderedDict()

    def observe(
        self, prompt_id: str, path: Sequence[ToolSignal], tokens_at: Sequence[int], total_tokens: int
    ) -> None:
        self.global_tree.observe(path, tokens_at, total_tokens)
        tree = self.prompts.get(prompt_id)
        if tree is None:
            tree = self.prompts[prompt_id] = CausalPrefixTree(min(self.window, 16), self.max_depth)
            if len(self.prompts) > self.max_prompts:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(prompt_id)
        tree.observe(path, tokens_at, total_tokens)

    def estimate(self, prompt_id: str, path: Sequence[ToolSignal], min_count: int = 8) -> Estimate | None:
        glob = self.global_tree.estimate(path, min_count)
        tree = self.prompts.get(prompt_id)
        if tree is not None:
            local = tree.estimate(path, self.prompt_min_count)
            if local is not None and (glob is None or local.depth >= glob.depth):
                return Estimate(local.mean, local.p90, local.count, local.depth, "prompt")
        return glob

    def to_dict(self, max_prompts: int | None = None) -> dict[str, Any]:
        """All of it, or the global tree and the `max_prompts` most recently used prompts' trees."""
        prompts = list(self.prompts.items())
        if max_prompts is not None:
            prompts = prompts[len(prompts) - max_prompts :] if max_prompts > 0 else []
        return {
            "window": self.window,
            "max_depth": self.max_depth,
            "max_prompts": self.max_prompts,
            "prompt_min_count": self.prompt_min_count,
            "global": self.global_tree.to_dict(),
            "prompts": {k: v.to_dict() for k, v in prompts},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixForest:
        forest = cls(
            int(data["window"]),
            int(data["max_depth"]),
            int(data["max_prompts"]),
            int(data["prompt_min_count"]),
        )
        forest.global_tree = CausalPrefixTree.from_dict(data["global"])
        forest.prompts = OrderedDict((k, CausalPrefixTree.from_dict(v)) for k, v in data["prompts"].items())
        return forest
