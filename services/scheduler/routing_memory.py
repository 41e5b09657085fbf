"""What the routing policy learned (C-MLFQ's prefix trees), kept across schedulers: the acting
scheduler saves it to Redis every `policy_save_s`; a restarted one loads it before it routes; a
standby keeps it loaded while it waits, so taking over does not wait for it (3.8 s at 1,024
engines on 2 cores) and reads the latest beside its work. Decoded and built in a thread, so the
event loop goes on meanwhile. The saved state stays under Redis's bound on one value: past it, the
per-prompt trees of the least recently used prompts are left out (the shared tree always kept)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from services.common.credentials import REDIS_MAX_VALUE_BYTES
from services.policy.routing import Router
from services.scheduler.ledger import Ledger, durably

STATE_BYTES = REDIS_MAX_VALUE_BYTES * 7 // 8
"""The most a saved routing state may take (1,024 engines' r2e_gym job passed Redis's 1 MB after
about 350 prompts: its writes failed, and the connection they broke cost the scheduler its lease)."""


def encode(router: Router, limit: int = STATE_BYTES) -> tuple[str, int]:
    """The router's learned state as JSON of at most `limit` bytes, and how many prompts' own
    trees it holds: all of them when they fit, else the most recently used that do."""
    raw = json.dumps(router.to_dict(), separators=(",", ":"))
    kept = router.learned_prompts
    while len(raw) > limit and kept > 0:
        kept = min(kept - 1, int(kept * limit / len(raw) * 0.95))  # trees are about alike in size
        raw = json.dumps(router.to_dict(kept), separators=(",", ":"))
    return raw, kept


class RoutingMemory:
    def __init__(self, router: Router, ledger: Ledger, save_s: float, log: Any):
        self.router, self.ledger, self.save_s, self.log = router, ledger, save_s, log
        self.warm = False
        """Loaded while this scheduler stood by."""
        self._last_raw: str | None = None
        """The saved state as last read: one read again unchanged is not built again."""
        self._saved = time.monotonic()
        self._lock = threading.Lock()
        self._reads = self._applied = 0
        self._trimmed = False

    async def keep_warm(self, waiting: asyncio.Event) -> None:
        """A standby's: loads the saved state now and every `save_s` while `waiting` is set."""
        while waiting.is_set():
            if await self.load(quiet=True) and not self.warm:
                self.warm = True
                self.log.info("policy_state_warm")
            deadline = time.monotonic() + self.save_s
            while waiting.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(min(0.2, self.save_s))

    async def take_up(self, spawn: Any) -> None:
        """As this scheduler takes the job: a warm state routes now and the latest replaces it
        when read (`spawn`ed beside the work); otherwise the saved state is loaded first."""
        if self.warm:
            spawn(self._refresh())
        else:
            await self.load()

    async def save_if_due(self) -> None:
        if time.monotonic() - self._saved > self.save_s:
            self._saved = time.monotonic()
            raw, kept = encode(self.router)
            learned = self.router.learned_prompts
            if kept < learned and not self._trimmed:  # said once: from here on it is the rule
                self.log.info("policy_state_trimmed", prompts_kept=kept, prompts=learned, bytes=len(raw))
            self._trimmed = kept < learned
            await durably(self.ledger.save_policy(raw), self.log)

    async def _refresh(self) -> None:
        await self.load()

    async def load(self, quiet: bool = False) -> bool:
        """The saved state, if there is one (True: loaded)."""
        self._reads += 1
        read = self._reads
        try:
            raw = await self.ledger.load_policy()
            if raw is None:
                return False
            if raw == self._last_raw:
                return True  # nothing saved since: what it holds is the latest
            await asyncio.to_thread(self._apply, read, raw)
            self._last_raw = raw
        except Exception as err:
            self.log.warning("policy_state_unavailable", error=f"{type(err).__name__}: {err}")
            return False
        if not quiet:
            self.log.info("policy_state_restored", bytes=len(raw))
        return True

    def _apply(self, read: int, raw: str) -> None:
        """In a thread. A standby's read cancelled mid-way may still be building when the read at
        takeover is done: the later read wins, whichever finishes first."""
        state = json.loads(raw)
        with self._lock:
            if read > self._applied:
                self.router.load_dict(state)
                self._applied = read
