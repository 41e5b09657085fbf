"""What C-MLFQ learned, kept across schedulers on a real Redis (services/scheduler/routing_memory.py):
a standby keeps the acting scheduler's saved prefix trees loaded while it waits, takes the job up
routing with them, and the latest read wins whichever read finishes first."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog

from services.common.localstack import Server
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig
from services.policy.routing import build_router
from services.scheduler.ledger import Ledger
from services.scheduler.routing_memory import RoutingMemory


def _router() -> Any:
    return build_router(RunConfig().rollout.buckets, "cmlfq")


def _state(window: int) -> dict[str, Any]:
    """A saved state told apart by its trees' window."""
    state = _router().to_dict()
    state["forest"]["window"] = window
    return state


async def test_a_standby_keeps_the_saved_trees_loaded_and_the_latest_read_wins(
    redis_server: Server, run_id: str
) -> None:
    store = OwnershipStore.from_url(redis_server.url, run_id)
    log = structlog.get_logger()
    try:
        acting = Ledger(store.r, run_id)
        router = _router()
        memory = RoutingMemory(router, Ledger(store.r, run_id), save_s=0.2, log=log)
        waiting = asyncio.Event()
        waiting.set()
        warm = asyncio.ensure_future(memory.keep_warm(waiting))
        await asyncio.sleep(0.3)
        assert not memory.warm  # nothing saved yet: nothing to keep
        await acting.save_policy(_state(11))
        async with asyncio.timeout(5):
            while router.to_dict()["forest"]["window"] != 11:
                await asyncio.sleep(0.05)
        assert memory.warm
        await acting.save_policy(_state(12))  # the acting scheduler saves again: the standby follows
        async with asyncio.timeout(5):
            while router.to_dict()["forest"]["window"] != 12:
                await asyncio.sleep(0.05)
        waiting.clear()  # it took the job up: the loop ends
        await asyncio.wait_for(warm, 2)

        await acting.save_policy(_state(13))  # saved just before the takeover
        spawned: list[asyncio.Task[None]] = []
        await memory.take_up(lambda coro: spawned.append(asyncio.ensure_future(coro)))
        assert router.to_dict()["forest"]["window"] == 12  # routes with the warm trees at once...
        await asyncio.gather(*spawned)
        assert router.to_dict()["forest"]["window"] == 13  # ...and the latest once read

        memory._apply(99, json.dumps(_state(20)))  # a later read applied first
        memory._apply(98, json.dumps(_state(21)))  # an earlier one finishing after it
        assert router.to_dict()["forest"]["window"] == 20

        cold = _router()  # a restarted scheduler that did not stand by loads before it routes
        await RoutingMemory(cold, Ledger(store.r, run_id), 10.0, log).take_up(lambda coro: None)
        assert cold.to_dict()["forest"]["window"] == 13
    finally:
        await store.close()
