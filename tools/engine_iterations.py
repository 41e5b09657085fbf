"""The iterations a live job's real engines ran, set against the cost model that predicts them.

`libra bench live --backend vllm` has every engine log its iterations (`engine.iteration_log`,
services/generation/iteration_log.py). Here each iteration is priced as the simulator prices an
engine alone from the same profile (`CostModel`: a decode iteration of its batch at its mean
context with the per-iteration overhead, plus the prompt tokens prefilled with it), and the sums
compared: what the offline calibration (`libra calibrate`: one engine, clean batches of equal
requests) says an iteration of that shape costs, against what it cost inside the job. Iterations
that ran while another engine of the host was mid-iteration are set apart from those that ran
alone, and `Calibration.host_sharing` (how much engines sharing a host slow each other) is fitted
to them: the one constant a single engine's calibration cannot measure.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

from services.common.cost_model import CostModel
from services.generation.iteration_log import Iteration

BATCH_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64), (65, 1 << 30))
ALONE, BESIDE = 0.25, 0.75
"""An iteration ran alone when another engine was mid-iteration for less than this share of it,
beside one when for more than that."""


STALE = 1.5
"""Iterations that ran alone in a live job costing more than this times their price in the
profile (or less than its inverse): the profile does not describe the host as it is now. On the
same day they cost 1.11-1.28x (the rest of the stack takes some of the CPU); on 2026-11-30 the
same 2-core VM, whose profile had been measured two days before, ran them at 2.1-2.3x, and a
calibration then measured its decode iterations twice as slow as the profile's
(`docs/simulator.md`)."""


def window(its: list[Iteration], start: float, end: float) -> list[Iteration]:
    return [it for it in its if start <= it.t <= end]


def priced(it: Iteration, cm: CostModel) -> float:
    """The cost model's seconds for `it` on one device: a decode (verify) iteration of its batch,
    or the bare per-iteration overhead when it only prefilled, plus its prompt tokens' prefill."""
    step = (
        cm.verify_step_s(it.decode, it.context, 1, it.decode_tokens)
        if it.decode
        else cm.calib.decode_overhead_s
    )
    return step + cm.prefill_s(it.prefill_tokens, 0, 1)


def _sums(its: list[Iteration], cm: CostModel) -> dict[str, Any]:
    timed = [it for it in its if it.dt is not None]
    live = sum(it.dt or 0.0 for it in timed)
    model = sum(it.model_s for it in timed)
    cost = sum(priced(it, cm) for it in timed)
    return {
        "iterations": len(its),
        "timed": len(timed),
        "live_s": round(live, 3),
        "forward_s": round(model, 3),
        "priced_s": round(cost, 3),
        "live_over_priced": round(live / cost, 4) if cost else None,
        "forward_over_priced": round(model / cost, 4) if cost else None,
    }


STALL = 2.0
"""An iteration stalled when it took more than this times the median of its group (both against
their prices)."""


def spread(its: list[Iteration], cm: CostModel) -> dict[str, Any] | None:
    """How a group's iterations spread around their prices (each iteration's time over its price):
    the median, the mean, the 99th percentile, and the iterations that stalled (past `STALL` x the
    median) with their share of the group's time. A uniform slowdown moves the median; stalls move
    the mean and leave the median where it was. None without a timed iteration."""
    timed = [(it.dt or 0.0, priced(it, cm)) for it in its if it.dt is not None and it.dt > 0]
    if not timed:
        return None
    ratios = sorted(live / price for live, price in timed)
    median = statistics.median(ratios)
    stalled = [live for live, price in timed if live / price > STALL * median]
    return {
        "median": round(median, 4),
        "mean": round(statistics.mean(ratios), 4),
        "p99": round(ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))], 4),
        "stalled": round(len(stalled) / len(timed), 4),
        "stalled_time": round(sum(stalled) / sum(live for live, _ in timed), 4),
    }


def compare(its: list[Iteration], cm: CostModel) -> dict[str, Any]:
    """Live iteration time against the cost model's price of the same iterations: all of them,
    decode-only and mixed (prompts prefilled with the decodes) apart, and decode-only by batch size.
    Only iterations timed back to back count (`dt`: the engine had work left after the previous
    one); `forward_s` is the model's forward and sampling alone, the rest of `live_s` is vLLM's
    scheduling and output handling."""
    decode = [it for it in its if it.decode and not it.prefill_tokens]
    mixed = [it for it in its if it.prefill_tokens]
    by_batch = []
    for lo, hi in BATCH_BINS:
        group = [it for it in decode if lo <= it.decode <= hi and it.dt is not None]
        if not group:
            continue
        live = statistics.mean(it.dt or 0.0 for it in group)
        cost = statistics.mean(priced(it, cm) for it in group)
        by_batch.append(
            {
                "batch": str(lo) if lo == hi else f"{lo}-{hi}",
                "iterations": len(group),
                "context_mean": round(statistics.mean(it.context for it in group), 1),
                "live_ms": round(live * 1000, 2),
                "forward_ms": round(statistics.mean(it.model_s for it in group) * 1000, 2),
                "priced_ms": round(cost * 1000, 2),
                "live_over_priced": round(live / cost, 4),
            }
        )
    batches = [it.decode for it in decode]
    return {
        "all": _sums(its, cm),
        "decode_only": _sums(decode, cm),
        "with_prefill": _sums(mixed, cm),
        "by_batch": by_batch,
        "decode_batch_mean": round(statistics.mean(batches), 2) if batches else None,
        "decode_context_mean": round(statistics.mean(it.context for it in decode), 1) if decode else None,
        "tokens": sum(it.decode_tokens for it in its) + sum(it.prefill for it in its),
    }


def _span(it: Iteration) -> tuple[float, float]:
    return it.t - (it.dt if it.dt is not None else it.model_s), it.t


class _Union:
    """The union of time intervals, for how much of [a, b] it covers."""

    def __init__(self, spans: list[tuple[float, float]]):
        merged: list[list[float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def covered(self, a: float, b: float) -> float:
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        total = 0.0
        while i < len(self.starts) and self.starts[i] < b:
            total += max(0.0, min(b, self.ends[i]) - max(a, self.starts[i]))
            i += 1
        return total


def with_others(
    engines: dict[str, list[Iteration]], start: float, end: float
) -> list[tuple[Iteration, float]]:
    """Each engine's decode-only iterations timed back to back in [start, end], with how many
    other engines were mid-iteration during it (on average over its span)."""
    unions = {name: _Union([_span(it) for it in its]) for name, its in engines.items()}
    out = []
    for name, its in engines.items():
        for it in window(its, start, end):
            if it.dt is None or it.dt <= 0 or not it.decode or it.prefill_tokens:
                continue
            a, b = _span(it)
            out.append((it, sum(u.covered(a, b) for o, u in unions.items() if o != name) / (b - a)))
    return out


def host_sharing(its: list[tuple[Iteration, float]], cm: CostModel) -> float | None:
    """`Calibration.host_sharing` fitted to `its` (`with_others`): least squares of each
    iteration's time against its price alone times 1 + sharing x the other engines mid-iteration;
    None when no iteration ran beside another."""
    priced_ = [(it.dt or 0.0, priced(it, cm), k) for it, k in its]
    den = sum((p * k) ** 2 for _, p, k in priced_)
    if den <= 0:
        return None
    return max(0.0, sum(p * k * (live - p) for live, p, k in priced_) / den)


def beside(engines: dict[str, list[Iteration]], cm: CostModel, start: float, end: float) -> dict[str, Any]:
    """Decode iterations that ran while no other engine of the host was mid-iteration, against
    those that ran beside one (the cost model prices an engine alone, times 1 + host_sharing per
    other engine mid-iteration), and the host sharing fitted to them."""
    its = with_others(engines, start, end)
    alone, beside_ = [it for it, k in its if k < ALONE], [it for it, k in its if k > BESIDE]
    return {
        "alone": _sums(alone, cm) | {"spread": spread(alone, cm)},
        "beside_another": _sums(beside_, cm) | {"spread": spread(beside_, cm)},
        "host_sharing_fitted": host_sharing(its, cm),
        "host_sharing_profile": cm.calib.host_sharing,
    }


def stale_profile(host: dict[str, Any]) -> str | None:
    """What to say when the iterations that ran alone (`beside`) are `STALE` off the profile's
    price: predictions from it are then off by as much, whatever else they model."""
    ratio = host["alone"]["live_over_priced"]
    if ratio is None or 1 / STALE <= ratio <= STALE:
        return None
    return (
        f"the profile does not describe this host now: engine iterations that ran alone cost "
        f"{ratio:.2f}x its price (1.1-1.3x is the rest of the stack's share of a CPU host); a "
        "profile holds for the host and the day it was measured on: run `libra calibrate` here "
        "and pass the new profile"
    )


def with_sharing(profile: dict[str, Any], sharing: float, source: str) -> dict[str, Any]:
    """`profile` (as read) with `host_sharing` set, and where it came from."""
    return profile | {
        "calibration": {**profile["calibration"], "host_sharing": round(sharing, 4)},
        "measured": {**profile.get("measured", {}), "host_sharing_from": source},
    }
