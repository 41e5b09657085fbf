"""The tool-sandbox's service shell: tool calls in over a NATS queue group (so replicas share the
load), tool returns out with the outcome features C-MLFQ routes by."""

from __future__ import annotations

import asyncio
import contextlib
import json

from opentelemetry import trace

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.errors import InvalidMessage
from services.common.logging import get_logger
from services.common.membership import Membership
from services.common.metrics import sandbox_metrics
from services.common.runconfig import RunConfig
from services.common.tracing import tracer
from services.tool_sandbox.agents import AgentJob, AgentSandboxes, EndpointBridge
from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.executor import SandboxExecutor, ToolOutcome
from services.tool_sandbox.outcome import Status
from services.tool_sandbox.tools.script import tool_plugin_files

QUEUE_GROUP = "tool-sandbox"
METRICS_PERIOD_S = 5.0


def to_proto(call: ev.ToolCall, out: ToolOutcome) -> ev.ToolReturn:
    return ev.ToolReturn(
        call_id=call.call_id,
        trajectory_id=call.trajectory_id,
        tool=out.tool,
        status=out.status,
        payload=out.payload,
        payload_bytes=out.payload_bytes,
        size_class=out.size_class,
        wall_s=out.wall_s,
        cpu_s=out.cpu_s,
        peak_rss_bytes=out.peak_rss_bytes,
        truncated=out.truncated,
        exit_code=out.exit_code,
        error=out.error,
    )


class ToolSandboxService:
    def __init__(self, bus: Bus, executor: SandboxExecutor, agents: AgentSandboxes | None = None):
        """`agents`: the job's sandboxed agent (`task.agent_sandbox`), run on request."""
        self.bus = bus
        self.executor = executor
        self.agents = agents
        self.log = get_logger(component="tool_sandbox")

    async def start(self) -> None:
        await self.bus.subscribe(subjects.TOOL_CALL, ev.ToolCall, self._on_call, queue=QUEUE_GROUP)
        if self.agents is not None:
            await self.bus.subscribe(subjects.AGENT_RUN, ev.AgentRun, self._on_agent_run, queue=QUEUE_GROUP)
            await self.bus.subscribe(subjects.AGENT_CANCEL, ev.AgentCancel, self._on_agent_cancel)
        m = sandbox_metrics()
        for tool in sorted(self.executor.tool_names):  # every series exists from the start, at 0
            m.seconds.labels(tool)
            for status in Status:
                m.calls.labels(tool, status.value)
        self.bus.spawn(self._report_metrics())

    async def _on_call(self, call: ev.ToolCall, env: Envelope) -> None:
        # Each call runs on its own task so one slow tool does not hold up the subscription.
        self.bus.spawn(self._run(call, env))

    async def _run(self, call: ev.ToolCall, env: Envelope) -> None:
        with tracer().start_as_current_span(
            "tool.execute",
            context=env.context,
            attributes={"libra.tool": call.tool, "libra.call_id": call.call_id},
        ) as span:
            try:
                args = json.loads(call.args_json or "{}")
            except json.JSONDecodeError:
                args = None  # the executor rejects anything that is not an object, with a typed error
            timeout = call.timeout_s if call.timeout_s > 0 else None
            out = await self.executor.execute(tool=call.tool, args=args, timeout_s=timeout)
            span.set_attribute("libra.tool_status", out.status)
            tool = out.tool if out.tool in self.executor.tool_names else "unknown"  # bounded labels
            sandbox_metrics().calls.labels(tool, out.status).inc()
            sandbox_metrics().seconds.labels(tool).observe(out.wall_s)
            span.set_attribute("libra.size_class", out.size_class)
            self.log.info(
                "tool_returned",
                trajectory_id=call.trajectory_id,
                tool=call.tool,
                status=out.status,
                wall_s=round(out.wall_s, 4),
                payload_bytes=out.payload_bytes,
                error=out.error[:200] or None,
            )
            await self.bus.publish(
                subjects.TOOL_RETURN, to_proto(call, out), ctx=trace.set_span_in_context(span)
            )

    async def _on_agent_run(self, run: ev.AgentRun, env: Envelope) -> None:
        """Takes the run and says so, or says why not (nothing started); its end goes out on
        `agent.return`. Asked again for a run it already has, it says again that it has it."""
        assert self.agents is not None
        ack = ev.AgentRunAccepted(trajectory_id=run.trajectory_id, worker_id=self.bus.worker_id)
        if not self.agents.holds(run.trajectory_id):
            try:
                bridge = self.agents.accept(run)
            except InvalidMessage as e:
                ack.refused = f"{e.code}: {e}"
                await self.bus.report_error(env.subject, e.code, str(e))
            else:
                self.bus.spawn(self._run_agent(run, bridge, env))
        await self.bus.publish(subjects.AGENT_ACCEPTED, ack)

    async def _run_agent(self, run: ev.AgentRun, bridge: EndpointBridge, env: Envelope) -> None:
        assert self.agents is not None
        with tracer().start_as_current_span(
            "agent.sandboxed", context=env.context, attributes={"libra.trajectory_id": run.trajectory_id}
        ) as span:
            ret = await self.agents.run(run, bridge)
            ret.worker_id = self.bus.worker_id
            span.set_attribute("libra.agent_failure", ret.failure)
            self.log.info(
                "agent_returned",
                trajectory_id=run.trajectory_id,
                failure=ret.failure or None,
                wall_s=round(ret.wall_s, 3),
                cpu_s=round(ret.cpu_s, 3),
                message=ret.message[:200] or None,
            )
            await self.bus.publish(subjects.AGENT_RETURN, ret, ctx=trace.set_span_in_context(span))

    async def _on_agent_cancel(self, cancel: ev.AgentCancel, env: Envelope) -> None:
        assert self.agents is not None
        if cancel.sandbox_id in ("", self.bus.worker_id):
            self.agents.cancel(cancel.trajectory_id)

    async def _report_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_PERIOD_S)
            values = {
                k: float(v)
                for k, v in _flatten(self.executor.metrics()).items()
                if isinstance(v, int | float)
            }
            sample = ev.MetricSample(service="tool-sandbox", worker_id=self.bus.worker_id, values=values)
            await self.bus.publish(subjects.METRICS, sample)


def _flatten(d: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    settings = load_settings(SandboxSettings)
    assert common.worker_id is not None
    plugins = tool_plugin_files(run.task.tool_plugins)
    executor = SandboxExecutor(settings, plugins)
    await executor.start()
    stack.push_async_callback(executor.close)
    bus = await Bus.connect(
        common.nats_url,
        common.run_id,
        "tool-sandbox",
        common.worker_id,
        common.nats_auth(),
        common.nats_tls(),
    )
    stack.push_async_callback(bus.close)
    store = common.ownership_store()
    stack.push_async_callback(store.close)
    await Membership(bus, store, ev.WorkerHello(worker_id=common.worker_id, kind="tool-sandbox")).start()
    agents = None
    if run.task.agent_sandbox:
        ca_file = tls.ca_file if (tls := common.tls()) is not None else None
        job = AgentJob(run.task.agent, run.task.plugin_paths, run.task.agent_command)
        agents = AgentSandboxes(settings, job, ca_file)
        await agents.start()
        stack.push_async_callback(agents.close)
    await ToolSandboxService(bus, executor, agents).start()
    get_logger().info("tool_sandbox_ready", tools=sorted(executor.tool_schemas()))
    await stop.wait()
