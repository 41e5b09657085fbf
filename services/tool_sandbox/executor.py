"""The sandbox executor: validates a call, bounds concurrency, runs the tool, classifies the outcome.

The NATS service shell and the one-off CLI both drive this class, so what the CLI prints is what
the scheduler receives.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Any

import structlog

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.isolation import (
    ProcessResult,
    SandboxProcess,
    bwrap_argv,
    enable_subreaper,
    host_credentials,
    reachable_bwrap,
)
from services.tool_sandbox.outcome import Status, ToolOutcome, size_class
from services.tool_sandbox.pool import WarmPool
from services.tool_sandbox.tools import Tool, ToolResult, build_tools
from services.tool_sandbox.tools.schema import validate
from services.tool_sandbox.tools.script import ToolPluginError, plugin_tools

__all__ = ["SandboxExecutor", "ToolOutcome"]

log = structlog.get_logger()


class _ToolStats:
    def __init__(self, window: int) -> None:
        self.by_status: Counter[str] = Counter()
        self.by_size_class: Counter[str] = Counter()
        self.latencies: deque[float] = deque(maxlen=window)

    def record(self, outcome: ToolOutcome, latency_s: float) -> None:
        self.by_status[outcome.status] += 1
        self.by_size_class[outcome.size_class] += 1
        self.latencies.append(latency_s)

    def snapshot(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

        return {
            "calls": sum(self.by_status.values()),
            "by_status": dict(self.by_status),
            "by_size_class": dict(self.by_size_class),
            "latency_p50_s": pct(0.5),
            "latency_p99_s": pct(0.99),
        }


class SandboxExecutor:
    """Runs tool calls; `execute` never raises for bad input, it returns a `rejected` outcome."""

    def __init__(self, settings: SandboxSettings | None = None, plugins: list[str] | None = None) -> None:
        """`plugins`: tool plugin files (task.tool_plugins) beside the built-in tools."""
        self.settings = settings or SandboxSettings()
        self._tools: dict[str, Tool] = build_tools(self.settings)
        for name, tool in plugin_tools(self.settings, plugins or []).items():
            if name in self._tools:
                raise ToolPluginError(f"tool plugin {name!r} has the name of a built-in tool")
            self._tools[name] = tool
        self._schemas = {name: tool.schema() for name, tool in self._tools.items()}
        self.tool_names = frozenset(self._tools)
        self._slots = asyncio.Semaphore(self.settings.max_concurrency)
        self._waiting = 0
        self._in_flight = 0
        self._active: set[SandboxProcess] = set()
        self._stats = {name: _ToolStats(self.settings.latency_window) for name in self._tools}
        self._rejected_unknown = 0
        self._argv: list[str] = []
        self._credentials: dict[str, Any] = {}
        self._pool: WarmPool | None = None
        self._closed = False

    async def start(self) -> None:
        """Resolve bwrap, prove a sandbox starts, load tool indexes and fill the warm pool."""
        if not enable_subreaper():
            log.warning("sandbox_subreaper_unavailable")
        bwrap = await asyncio.to_thread(reachable_bwrap, self.settings)
        self._argv = bwrap_argv(self.settings, bwrap)
        self._credentials = host_credentials(self.settings)
        probe = await self._run_in_sandbox(SandboxProcess.spawn(self._argv, self._credentials), {
            "kind": "python", "code": "print('ready')"}, 10.0)  # fmt: skip
        if probe.exit_code != 0 or probe.stdout.strip() != b"ready":
            raise RuntimeError(
                f"sandbox self-test failed (exit {probe.exit_code}): {probe.stderr.decode(errors='replace')}"
                " — are unprivileged user namespaces enabled?"
            )
        for tool in self._tools.values():
            await tool.start()
        self._pool = WarmPool(self._spawn, self.settings.pool_size)
        self._pool.start()
        log.info(
            "sandbox_executor_started",
            bwrap=bwrap,
            python=self.settings.python_executable,
            pool_size=self.settings.pool_size,
            max_concurrency=self.settings.max_concurrency,
        )

    def _spawn(self) -> SandboxProcess:
        return SandboxProcess.spawn(self._argv, self._credentials)

    async def close(self) -> None:
        """Kill every sandbox, warm or running; scratch lives in each sandbox's tmpfs and goes with it."""
        self._closed = True
        if self._pool is not None:
            await self._pool.close()
        active = list(self._active)
        await asyncio.gather(*(sandbox.terminate() for sandbox in active), return_exceptions=True)
        log.info("sandbox_executor_closed", killed_in_flight=len(active))

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        return {name: dict(schema) for name, schema in self._schemas.items()}

    def tool_descriptions(self) -> dict[str, str]:
        return {
            name: getattr(tool, "tool_description", tool.description) for name, tool in self._tools.items()
        }

    def metrics(self) -> dict[str, Any]:
        pool = self._pool
        return {
            "tools": {name: stats.snapshot() for name, stats in self._stats.items()},
            "rejected_unknown_tool": self._rejected_unknown,
            "in_flight": self._in_flight,
            "queue_depth": self._waiting,
            "max_concurrency": self.settings.max_concurrency,
            "max_queue": self.settings.max_queue,
            "pool": {
                "size": pool.size if pool else 0,
                "ready": pool.ready if pool else 0,
                "hits": pool.hits if pool else 0,
                "misses": pool.misses if pool else 0,
                "spawn_failures": pool.spawn_failures if pool else 0,
            },
        }

    async def execute(self, tool: str, args: Any, timeout_s: float | None = None) -> ToolOutcome:
        start = time.perf_counter()
        impl = self._tools.get(tool)
        if impl is None:
            self._rejected_unknown += 1
            known = ", ".join(sorted(self._tools))
            return self._finish(
                tool, ToolResult(Status.REJECTED, error=f"unknown tool {tool!r}; known: {known}")
            )
        problems = validate(self._schemas[tool], args)
        timeout, timeout_problem = self._timeout(timeout_s)
        if problems or timeout_problem:
            error = "; ".join(problems + ([timeout_problem] if timeout_problem else []))
            return self._record(tool, self._finish(tool, ToolResult(Status.REJECTED, error=error)), start)
        if self._closed or self._pool is None:
            result = ToolResult(Status.REJECTED, error="executor is not running")
            return self._record(tool, self._finish(tool, result), start)
        if not impl.sandboxed:
            return self._record(tool, await self._call_in_process(impl, args, timeout), start)
        if self._slots.locked() and self._waiting >= self.settings.max_queue:
            result = ToolResult(Status.REJECTED, error=f"queue full ({self.settings.max_queue} waiting)")
            return self._record(tool, self._finish(tool, result), start)
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._in_flight += 1
        try:
            began = time.perf_counter()
            result = await self._guarded(impl, args, timeout)
            outcome = self._finish(tool, result, wall_s=time.perf_counter() - began)
        finally:
            self._in_flight -= 1
            self._slots.release()
        return self._record(tool, outcome, start)

    def _timeout(self, timeout_s: Any) -> tuple[float, str]:
        if timeout_s is None:
            return self.settings.default_timeout_s, ""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            return 0.0, f"timeout_s: must be a positive number, got {timeout_s!r}"
        return min(float(timeout_s), self.settings.max_timeout_s), ""

    async def _guarded(self, impl: Tool, args: dict[str, Any], timeout: float) -> ToolResult:
        try:
            return await impl.call(args, self._sandbox_run, timeout)
        except Exception as exc:
            log.exception("sandbox_tool_failed", tool=impl.name)
            return ToolResult(Status.ERROR, error=f"internal error: {type(exc).__name__}: {exc}")

    async def _call_in_process(self, impl: Tool, args: dict[str, Any], timeout: float) -> ToolOutcome:
        began, cpu0 = time.perf_counter(), time.thread_time()
        result = await self._guarded(impl, args, timeout)
        return self._finish(
            impl.name, result, wall_s=time.perf_counter() - began, cpu_s=time.thread_time() - cpu0
        )

    async def _sandbox_run(self, request: dict[str, Any], timeout_s: float) -> ProcessResult:
        assert self._pool is not None
        return await self._run_in_sandbox(self._pool.acquire(), request, timeout_s)

    async def _run_in_sandbox(
        self, sandbox: SandboxProcess, request: dict[str, Any], timeout_s: float
    ) -> ProcessResult:
        self._active.add(sandbox)
        try:
            return await sandbox.run(
                request,
                timeout_s=timeout_s,
                cpu_s=self.settings.cpu_time_s,
                output_limit=self.settings.max_output_bytes,
            )
        finally:
            self._active.discard(sandbox)

    def _finish(self, tool: str, result: ToolResult, wall_s: float = 0.0, cpu_s: float = 0.0) -> ToolOutcome:
        payload_bytes = len(result.payload.encode("utf-8"))
        process = result.process
        return ToolOutcome(
            tool=tool,
            status=result.status.value,
            payload=result.payload,
            payload_bytes=payload_bytes,
            size_class=size_class(
                payload_bytes, self.settings.size_class_medium_bytes, self.settings.size_class_large_bytes
            ).value,
            wall_s=wall_s,
            cpu_s=process.cpu_s if process else cpu_s,
            peak_rss_bytes=process.peak_rss_bytes if process else 0,
            truncated=result.truncated,
            exit_code=result.exit_code,
            error=result.error,
        )

    def _record(self, tool: str, outcome: ToolOutcome, start: float) -> ToolOutcome:
        self._stats[tool].record(outcome, time.perf_counter() - start)
        if outcome.status != Status.OK:
            log.debug("sandbox_call_not_ok", tool=tool, status=outcome.status, error=outcome.error)
        return outcome
