"""What C-MLFQ learned, kept across schedulers on a real Redis (services/scheduler/routing_memory.py):
a standby keeps the acting scheduler's saved prefix trees loaded while it waits, takes the job up
routing with them, and the latest read wins whichever read finishes first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from services.common.credentials import REDIS_MAX_VALUE, REDIS_MAX_VALUE_BYTES
from services.common.localstack import Server, start_redis
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig
from services.policy.prefix_tree import ToolSignal
from services.policy.routing import build_router
from services.scheduler.ledger import Ledger
from services.scheduler.routing_memory import STATE_BYTES, RoutingMemory


def _router() -> Any:
    return build_router(RunConfig().rollout.buckets, "cmlfq")


def _state(window: int) -> dict[str, Any]:
    """A saved state told apart by its trees' window."""
    state = _router().to_dict()
    state["forest"]["window"] = window
    return state


def _json(window: int) -> str:
    return json.dumps(_state(window))


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
        await acting.save_policy(_json(11))
        async with asyncio.timeout(5):
            while router.to_dict()["forest"]["window"] != 11 or not memory.warm:
                await asyncio.sleep(0.05)  # (the trees are in before the read returns)
        await acting.save_policy(_json(12))  # the acting scheduler saves again: the standby follows
        async with asyncio.timeout(5):
            while router.to_dict()["forest"]["window"] != 12:
                await asyncio.sleep(0.05)
        waiting.clear()  # it took the job up: the loop ends
        await asyncio.wait_for(warm, 2)

        await acting.save_policy(_json(13))  # saved just before the takeover
        spawned: list[asyncio.Task[None]] = []
        await memory.take_up(lambda coro: spawned.append(asyncio.ensure_future(coro)))
        assert router.to_dict()["forest"]["window"] == 12  # routes with the warm trees at once...
        await asyncio.gather(*spawned)
        assert router.to_dict()["forest"]["window"] == 13  # ...and the latest once read
        forest = router.core.forest
        assert await memory.load()  # read again, nothing saved since: not built again
        assert router.core.forest is forest

        memory._apply(99, json.dumps(_state(20)))  # a later read applied first
        memory._apply(98, json.dumps(_state(21)))  # an earlier one finishing after it
        assert router.to_dict()["forest"]["window"] == 20

        cold = _router()  # a restarted scheduler that did not stand by loads before it routes
        await RoutingMemory(cold, Ledger(store.r, run_id), 10.0, log).take_up(lambda coro: None)
        assert cold.to_dict()["forest"]["window"] == 13
    finally:
        await store.close()


async def test_a_learned_state_past_redis_bound_is_saved_trimmed_and_the_connection_stays_up(
    tmp_path: Path, run_id: str
) -> None:
    """At 1,024 engines C-MLFQ's trees outgrew Redis's bound on one value (`proto-max-bulk-len`,
    as the stack runs it): each save was a protocol error that dropped the connection, and with it
    the scheduler's lease renewals. Saved now within the bound, the least recently used prompts'
    own trees left out; nothing over it is ever sent."""
    conf = tmp_path / "redis.conf"
    conf.write_text(f"proto-max-bulk-len {REDIS_MAX_VALUE}\n")
    server = start_redis(tmp_path / "redis", config=conf)
    store = OwnershipStore.from_url(server.url, run_id)
    log = structlog.get_logger()
    try:
        router = _router()
        ok, fail = ToolSignal("shell", "small", "success"), ToolSignal("python", "large", "failure")
        for p in range(4000):  # the forest keeps up to 4,096 prompts' trees
            for k in range(8):
                router.core.forest.observe(
                    f"prompt-{p}", [ok, fail, ok], [100 + k, 300 + k, 500 + k], 1000 + p + k
                )
        whole = json.dumps(router.to_dict(), separators=(",", ":"))
        assert len(whole) > REDIS_MAX_VALUE_BYTES
        other = OwnershipStore.from_url(server.url, run_id)  # what each save did before: the bound is real
        with pytest.raises(Exception, match="(?i)protocol|bulk|reset|closed"):
            await other.r.set("too-large", whole)
        await other.close()
        ledger = Ledger(store.r, run_id)
        with pytest.raises(ValueError, match="over Redis"):
            await ledger.save_policy(whole)  # refused before it is sent

        memory = RoutingMemory(router, ledger, save_s=0.0, log=log)
        await memory.save_if_due()
        raw = await ledger.load_policy()
        assert raw is not None and len(raw) <= STATE_BYTES
        cold = _router()
        await RoutingMemory(cold, Ledger(store.r, run_id), 10.0, log).take_up(lambda coro: None)
        kept = cold.learned_prompts
        assert 0 < kept < 4000
        assert list(cold.core.forest.prompts) == [f"prompt-{p}" for p in range(4000 - kept, 4000)]
        assert cold.to_dict(0) == router.to_dict(0)  # the shared tree whole
        assert await store.acquire("lease-after", "me", 10) is not None  # the connection serves on
    finally:
        await store.close()
        server.stop()
