"""Agentic workloads as data: trajectories are sampled from a YAML description (`workloads/`).

The simulator samples its trajectories here, and the live scheduler's synthetic task
(`task.dataset: synthetic`) draws the same trajectories, so both run the same workload.

A prompt has a latent difficulty d ~ Beta(a, b) shared by its GRPO samples. Each turn emits
lognormal output tokens; then either the trajectory answers (probability `stop[previous status]`)
or it calls a tool whose outcome (success / failure / timeout, payload size class) is drawn from
per-tool probabilities that get worse with d. Outcomes multiply later turns' tokens (`effects`),
so the tool-return history carries real information about the remaining work, which is what
C-MLFQ's prefix tree learns. `drift` moves the distribution with the RL step.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from services.common.signals import ToolSignal

WORKLOAD_DIR = Path(__file__).parent / "workloads"
STATUSES = ("success", "failure", "timeout")
SIZES = ("small", "medium", "large")
GROUP_MEMO = 1 << 15
"""Groups `Workload.group_for` keeps (a few tens of MB at most: a 1,024-GPU run draws ~5k)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    signal: ToolSignal
    latency_s: float
    payload_tokens: int


@dataclass(frozen=True, slots=True)
class Turn:
    output_tokens: int
    tool: ToolCall | None


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    prompt_id: str
    prompt_tokens: int
    turns: tuple[Turn, ...]

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def context_tokens(self) -> int:
        """Final context length: what the trainer sees."""
        tools = sum(t.tool.payload_tokens for t in self.turns if t.tool)
        return self.prompt_tokens + self.output_tokens + tools

    @property
    def tool_time_s(self) -> float:
        return sum(t.tool.latency_s for t in self.turns if t.tool)


_REQUIRED: dict[str, tuple[str, ...] | None] = {
    "name": None,
    "max_turns": None,
    "max_new_tokens": None,
    "prompt_tokens": ("median", "sigma"),
    "difficulty": ("a", "b"),
    "turn_tokens": ("median", "sigma"),
    "stop": ("first", "success", "failure", "timeout"),
    "tools": None,
    "payload_tokens": SIZES,
    "effects": STATUSES,
}
_TOOL_REQUIRED: dict[str, tuple[str, ...] | None] = {
    "weight": None,
    "latency": ("median_s", "sigma"),
    "timeout_s": None,
    "outcomes": None,
}
_OPTIONAL: dict[str, tuple[str, ...] | None] = {
    "group_size": None,
    "prompts_per_step": None,
    "max_context_tokens": None,
    "drift": ("turn_tokens_mult", "stop_shift"),
}
_EXTRA_SUBFIELDS = {
    "turn_tokens": ("difficulty_gain",),
    "stop": ("difficulty_stop_cut",),
    "effects": ("large_payload",),
}
_TOOL_OPTIONAL = ("difficulty_failure", "payload")


def _no_unknown(where: str, data: dict[str, Any], known: Any) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _check(where: str, data: Any, required: dict[str, tuple[str, ...] | None]) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    for key, sub in required.items():
        if key not in data:
            raise ValueError(f"{where}: missing field {key!r}")
        if sub is not None:
            if not isinstance(data[key], dict):
                raise ValueError(f"{where}: field {key!r} must be a mapping with {', '.join(sub)}")
            missing = [k for k in sub if k not in data[key]]
            if missing:
                raise ValueError(f"{where}: field {key!r} is missing {', '.join(missing)}")


def validate(spec: Any, where: str = "workload") -> None:
    """Raise ValueError naming the first missing or malformed field of a workload description."""
    _check(where, spec, _REQUIRED)
    _no_unknown(where, spec, {**_REQUIRED, **_OPTIONAL})
    for key, sub in {**_REQUIRED, **_OPTIONAL}.items():
        if sub is not None and key in spec:
            if not isinstance(spec[key], dict):
                raise ValueError(f"{where}: field {key!r} must be a mapping")
            _no_unknown(f"{where}: {key}", spec[key], (*sub, *_EXTRA_SUBFIELDS.get(key, ())))
    if not spec["tools"] or not isinstance(spec["tools"], dict):
        raise ValueError(f"{where}: 'tools' must map at least one tool name to its description")
    for name, tool in spec["tools"].items():
        _check(f"{where}: tool {name!r}", tool, _TOOL_REQUIRED)
        _no_unknown(f"{where}: tool {name!r}", tool, (*_TOOL_REQUIRED, *_TOOL_OPTIONAL))
        _no_unknown(f"{where}: tool {name!r}: outcomes", tool["outcomes"], STATUSES)
        if "payload" not in tool or not isinstance(tool["payload"], dict):
            raise ValueError(f"{where}: tool {name!r}: missing field 'payload'")
        if float(tool["weight"]) < 0 or not any(float(v) > 0 for v in tool["outcomes"].values()):
            raise ValueError(f"{where}: tool {name!r}: weight must be >= 0 and some outcome > 0")
        _no_unknown(f"{where}: tool {name!r}: payload", tool["payload"], SIZES)
    for key in ("max_turns", "max_new_tokens", "group_size", "prompts_per_step"):
        if key in spec and (not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1):
            raise ValueError(f"{where}: {key} must be an integer of at least 1, got {spec[key]!r}")
    if "max_context_tokens" in spec and int(spec["max_context_tokens"]) < 2:
        raise ValueError(f"{where}: max_context_tokens must be at least 2")


class TrajectorySource(Protocol):
    """What the simulator draws a run's trajectories from: a workload description (`Workload`) or
    what a live job has shown so far (`services/simulation/observed.py`)."""

    group_size: int
    prompts_per_step: int
    max_turns: int

    def group_for(self, seed: int, index: int, step: int, prompt_id: str) -> list[TrajectorySpec]: ...


class Workload:
    def __init__(self, spec: dict[str, Any], max_context: int = 0) -> None:
        """`max_context` is the model's position window; the smaller of it and the workload's
        `max_context_tokens` ends a trajectory whose context would not fit (0 = no limit)."""
        validate(spec)
        self.spec = spec
        limits = [c for c in (int(spec.get("max_context_tokens", 0)), max_context) if c > 0]
        self.max_context = min(limits) if limits else 1 << 62
        self.name: str = spec["name"]
        self.group_size = int(spec.get("group_size", 8))
        self.prompts_per_step = int(spec.get("prompts_per_step", 32))
        self.max_turns = int(spec["max_turns"])
        self.max_new = int(spec["max_new_tokens"])
        self.tools = spec["tools"]
        self._tool_names = list(self.tools)
        self._tool_cum = list(itertools.accumulate(float(self.tools[t]["weight"]) for t in self._tool_names))
        self._groups: dict[tuple[int, int, int, str], tuple[TrajectorySpec, ...]] = {}

    def with_overrides(self, max_context: int = 0, **fields: Any) -> Workload:
        return Workload(
            {**self.spec, **fields}, max_context or (self.max_context if self.max_context < 1 << 62 else 0)
        )

    @classmethod
    def load(cls, name_or_path: str | Path) -> Workload:
        p = Path(name_or_path)
        if not p.exists():
            p = WORKLOAD_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            shipped = ", ".join(sorted(f.stem for f in WORKLOAD_DIR.glob("*.yaml")))
            raise ValueError(
                f"workload {str(name_or_path)!r} is neither a file nor a shipped workload ({shipped})"
            )
        with open(p) as f:
            try:
                spec = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{p}: not valid YAML ({e})") from e
        try:
            validate(spec, str(p))
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from e
        return cls(spec)

    def group_for(self, seed: int, index: int, step: int, prompt_id: str) -> list[TrajectorySpec]:
        """The `index`-th group a run admits (counting replacements), drawn at RL step `step`: the
        same draw in the simulator and on the live stack for the same seed (common random numbers),
        whatever the timing. Draws are pure and immutable, so the last `GROUP_MEMO` are kept: the
        planner's what-if simulations on one seed draw the same groups again and again."""
        key = (seed, index, step, prompt_id)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= GROUP_MEMO:
                del self._groups[next(iter(self._groups))]
            group = tuple(self.sample_group(random.Random(f"{seed}:{index}"), prompt_id, step))
            self._groups[key] = group
        return list(group)

    def sample_group(self, rng: random.Random, prompt_id: str, step: int) -> list[TrajectorySpec]:
        s = self.spec
        d = rng.betavariate(float(s["difficulty"]["a"]), float(s["difficulty"]["b"]))
        pt = s["prompt_tokens"]
        prompt = int(float(pt["median"]) * math.exp(rng.gauss(0, float(pt["sigma"]))))
        prompt = max(1, min(prompt, self.max_context // 2))
        tools = self._tools_for(d)
        return [self._sample(rng, prompt_id, prompt, d, step, tools) for _ in range(self.group_size)]

    def _tools_for(self, d: float) -> list[tuple[str, list[float], list[float], float, float, float]]:
        """Per tool, for difficulty d: cumulative status and size weights, latency median and sigma, timeout."""
        out = []
        for name in self._tool_names:
            t = self.tools[name]
            probs = {k: float(v) for k, v in t["outcomes"].items()}
            extra = float(t.get("difficulty_failure", 0.0)) * d
            probs["failure"] = probs.get("failure", 0.0) + extra
            probs["success"] = max(0.0, probs.get("success", 0.0) - extra)
            status_cum = list(itertools.accumulate(probs.get(k, 0.0) for k in STATUSES))
            size_cum = list(itertools.accumulate(float(t["payload"].get(k, 0.0)) for k in SIZES))
            lat = t["latency"]
            out.append(
                (
                    name,
                    status_cum,
                    size_cum,
                    float(lat["median_s"]),
                    float(lat["sigma"]),
                    float(t["timeout_s"]),
                )
            )
        return out

    def _sample(
        self,
        rng: random.Random,
        prompt_id: str,
        prompt: int,
        d: float,
        step: int,
        tools: list[tuple[str, list[float], list[float], float, float, float]],
    ) -> TrajectorySpec:
        s = self.spec
        tt, stop, eff = s["turn_tokens"], s["stop"], s["effects"]
        drift = s.get("drift", {})
        median = float(tt["median"]) * float(drift.get("turn_tokens_mult", 1.0)) ** step
        median *= 1 + float(tt.get("difficulty_gain", 0.0)) * d
        sigma = float(tt["sigma"])
        shift = float(drift.get("stop_shift", 0.0)) * step
        cut = 1 - float(stop.get("difficulty_stop_cut", 0.0)) * d
        large = float(eff.get("large_payload", 1.0))
        payload_tokens = self.spec["payload_tokens"]
        tool_cum = self._tool_cum
        turns: list[Turn] = []
        used, mult, last = 0, 1.0, "first"
        context = prompt
        for i in range(self.max_turns):
            n = max(1, int(median * mult * math.exp(rng.gauss(0, sigma))))
            n = max(1, min(n, self.max_new - used, self.max_context - 1 - context))
            used += n
            context += n
            p_stop = max(0.0, min(1.0, (float(stop[last]) + shift) * cut))
            if (
                used >= self.max_new
                or context >= self.max_context - 1
                or i == self.max_turns - 1
                or rng.random() < p_stop
            ):
                turns.append(Turn(n, None))
                break
            name, status_cum, size_cum, med, sig, timeout = tools[
                bisect.bisect(tool_cum, rng.random() * tool_cum[-1])
            ]
            status = STATUSES[min(2, bisect.bisect(status_cum, rng.random() * status_cum[-1]))]
            size = SIZES[min(2, bisect.bisect(size_cum, rng.random() * size_cum[-1]))]
            latency = timeout if status == "timeout" else min(timeout, med * math.exp(rng.gauss(0, sig)))
            call = ToolCall(ToolSignal(name, size, status), latency, int(payload_tokens[size]))
            if context + call.payload_tokens >= self.max_context - 1:
                # The tool's return would not fit the window: the trajectory is truncated here.
                turns.append(Turn(n, None))
                break
            context += call.payload_tokens
            turns.append(Turn(n, call))
            last = status
            mult *= float(eff[last]) * (large if size == "large" else 1.0)
            mult = min(4.0, max(0.25, mult))
        return TrajectorySpec(prompt_id, prompt, tuple(turns))
