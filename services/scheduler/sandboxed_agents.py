"""`task.agent_sandbox`: each trajectory's agent run by a tool sandbox, in its isolation
(services/tool_sandbox/agents.py), instead of in an agent process beside the scheduler.

A run is asked for on `agent.run` (the sandboxes' queue group: one of them gets it). The sandbox
that takes it says so on its own `agent.accepted` (or says why it will not: a typed refusal, and
nothing started), and how it ended on its own `agent.return`; only that sandbox's word about the
run is believed. While no sandbox has taken a run it is asked again, for up to ACCEPT_PATIENCE_S
(a tool-sandbox service starting or restarting takes it once it is there); should two take it, the
later one is told to stop. A return that never comes (its sandbox died with the run) fails the
trajectory at `task.agent_timeout_s` plus a grace, as an agent that does not return does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.scheduler.agents import AgentOutcome, outcome_of
from services.scheduler.plugins import PluginFailure

RETURN_GRACE_S = 30.0
"""How much longer than the run's own timeout its return may take to arrive (the sandbox kills the
run at the timeout, then reaps it and answers)."""
ACCEPT_WAIT_S = 2.0
"""How long one ask waits for a sandbox to take the run before it asks again (doubling, to 10 s)."""
ACCEPT_PATIENCE_S = 60.0
"""How long a run waits for any sandbox to take it before it fails (`agent_crashed`)."""
FAILURES = frozenset({"agent_timeout", "agent_crashed", "agent_error", "agent_cancelled", "agent_invalid"})
"""The failures a sandbox may report; anything else it says is a crash."""


@dataclass
class _Run:
    accepted: asyncio.Future[ev.AgentRunAccepted]
    returned: asyncio.Future[ev.AgentReturn]
    sandbox: str = ""
    """The sandbox whose run it is (the first to take it)."""
    others: set[str] = field(default_factory=set)


class SandboxedAgents:
    """Runs the job's agent in the tool sandboxes; the interface of AgentPool (agents.py)."""

    def __init__(self, bus: Bus, timeout_s: float):
        self.bus, self.timeout_s = bus, timeout_s
        self.runs: dict[str, _Run] = {}

    async def start(self, env: dict[str, str] | None = None) -> None:
        """`env` is not used: the agent speaks plain HTTP to its sandbox's relay, and the
        sandbox service's bridge verifies the endpoint."""
        await self.bus.subscribe(subjects.AGENT_ACCEPTED, ev.AgentRunAccepted, self._on_accepted)
        await self.bus.subscribe(subjects.AGENT_RETURN, ev.AgentReturn, self._on_return)

    async def _on_accepted(self, ack: ev.AgentRunAccepted, env: Envelope) -> None:
        run = self.runs.get(ack.trajectory_id)
        if run is None:  # a run no longer asked for (it ended, or was asked twice): stop it
            if not ack.refused:
                await self._cancel(ack.trajectory_id, ack.worker_id)
            return
        if not run.accepted.done():
            run.sandbox = ack.worker_id
            run.accepted.set_result(ack)
        elif ack.worker_id != run.sandbox and not ack.refused:  # asked twice, taken twice
            run.others.add(ack.worker_id)
            await self._cancel(ack.trajectory_id, ack.worker_id)

    async def _on_return(self, ret: ev.AgentReturn, env: Envelope) -> None:
        run = self.runs.get(ret.trajectory_id)
        if run is not None and ret.worker_id == run.sandbox and not run.returned.done():
            run.returned.set_result(ret)

    async def run(
        self, trajectory_id: str, sample: dict[str, Any], base_url: str, api_key: str
    ) -> AgentOutcome:
        loop = asyncio.get_running_loop()
        run = self.runs[trajectory_id] = _Run(loop.create_future(), loop.create_future())
        ask = ev.AgentRun(
            trajectory_id=trajectory_id,
            sample_json=json.dumps(sample, default=str),
            api_key=api_key,
            base_url=base_url,
            timeout_s=self.timeout_s,
        )
        try:
            not_taken = await self._ask(ask, run)
            if not_taken is not None:
                return not_taken
            wait = self.timeout_s + RETURN_GRACE_S
            try:
                ret = await asyncio.wait_for(asyncio.shield(run.returned), wait)
            except TimeoutError:
                await self._cancel(trajectory_id, run.sandbox)
                return PluginFailure(
                    "agent_timeout", f"no word from tool sandbox {run.sandbox} within {wait:g} s"
                )
            return returned(ret)
        finally:
            if self.runs.get(trajectory_id) is run:
                del self.runs[trajectory_id]

    async def _ask(self, ask: ev.AgentRun, run: _Run) -> AgentOutcome | None:
        """None once a sandbox took the run; else why none did."""
        deadline = time.monotonic() + ACCEPT_PATIENCE_S
        wait = ACCEPT_WAIT_S
        while True:
            await self.bus.publish(subjects.AGENT_RUN, ask)
            either: list[asyncio.Future[Any]] = [run.accepted, run.returned]
            await asyncio.wait(either, timeout=max(0.0, min(wait, deadline - time.monotonic())))
            if run.returned.done():  # cancelled while it waited
                return returned(run.returned.result())
            if run.accepted.done():
                ack = run.accepted.result()
                if ack.refused:
                    return PluginFailure(
                        "agent_crashed", f"tool sandbox {ack.worker_id} refused the run: {ack.refused}"
                    )
                return None
            if time.monotonic() + 0.01 >= deadline:
                return PluginFailure(
                    "agent_crashed",
                    f"no tool sandbox took the run within {ACCEPT_PATIENCE_S:g} s (is the tool-sandbox service running?)",
                )
            wait = min(wait * 2, 10.0)

    def cancel(self, trajectory_id: str) -> None:
        """Stops the trajectory's run (its answer, if one still comes, is dropped)."""
        run = self.runs.get(trajectory_id)
        if run is None:
            return
        if not run.returned.done():
            run.returned.set_result(
                ev.AgentReturn(failure="agent_cancelled", message="the trajectory ended first")
            )
        for sandbox in {run.sandbox, *run.others}:
            self.bus.spawn(self._cancel(trajectory_id, sandbox))

    async def _cancel(self, trajectory_id: str, sandbox: str) -> None:
        with contextlib.suppress(Exception):  # the run ends at its timeout anyway
            await self.bus.publish(
                subjects.AGENT_CANCEL, ev.AgentCancel(trajectory_id=trajectory_id, sandbox_id=sandbox)
            )

    async def close(self) -> None:
        for trajectory_id in list(self.runs):
            self.cancel(trajectory_id)


def returned(ret: ev.AgentReturn) -> AgentOutcome:
    """The outcome of a sandboxed run from its return."""
    if ret.failure:
        kind = ret.failure if ret.failure in FAILURES else "agent_crashed"
        return PluginFailure(kind, ret.message[:500] or ret.failure)
    try:
        answer = json.loads(ret.answer_json)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return PluginFailure(
            "agent_crashed", f"the sandboxed agent gave no answer: {ret.answer_json[:200]!r}"
        )
    return outcome_of(answer)
