"""The tools through the real executor and real sandboxes: correct results, typed rejections, pooling."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.executor import SandboxExecutor

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
async def executor() -> AsyncIterator[SandboxExecutor]:
    ex = SandboxExecutor(SandboxSettings(pool_size=2, max_concurrency=2, default_timeout_s=5.0))
    await ex.start()
    yield ex
    await ex.close()


def result(payload: str) -> dict:
    return json.loads(payload)


async def test_python_returns_stdout_stderr_and_exit_code(executor: SandboxExecutor) -> None:
    out = await executor.execute(
        "python", {"code": "import sys\nprint(sum(range(10)))\nprint('warn', file=sys.stderr)"}
    )
    assert out.status == "ok" and out.exit_code == 0
    assert result(out.payload) == {"stdout": "45\n", "stderr": "warn\n", "exit_code": 0}
    assert out.payload_bytes == len(out.payload.encode()) and out.size_class == "small"
    assert out.wall_s > 0 and out.peak_rss_bytes > 0 and not out.truncated


async def test_python_errors_and_exit_codes(executor: SandboxExecutor) -> None:
    raised = await executor.execute("python", {"code": "1 / 0"})
    assert raised.status == "error" and raised.exit_code == 1
    assert "ZeroDivisionError" in result(raised.payload)["stderr"]
    exited = await executor.execute("python", {"code": "import sys\nsys.exit(3)"})
    assert exited.status == "error" and exited.exit_code == 3
    syntax = await executor.execute("python", {"code": "def ("})
    assert syntax.status == "error" and "SyntaxError" in result(syntax.payload)["stderr"]


async def test_python_has_a_private_writable_scratch(executor: SandboxExecutor) -> None:
    code = "import os, tempfile\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd(), os.listdir('.'))"
    out = await executor.execute("python", {"code": code})
    assert result(out.payload)["stdout"] == "/scratch ['note.txt']\n"
    again = await executor.execute("python", {"code": "import os\nprint(os.listdir('/scratch'))"})
    assert result(again.payload)["stdout"] == "[]\n"  # nothing survives from one call to the next


async def test_size_classes_follow_payload_size(executor: SandboxExecutor) -> None:
    medium = await executor.execute("python", {"code": "print('x' * 2000)"})
    large = await executor.execute("python", {"code": "print('x' * 40000)"})
    assert (medium.size_class, large.size_class) == ("medium", "large")


async def test_calculator(executor: SandboxExecutor) -> None:
    out = await executor.execute("calculator", {"expression": "2 ** 10 + sqrt(16)"})
    assert (out.status, out.payload) == ("ok", "1028")
    bad = await executor.execute("calculator", {"expression": "__import__('os')"})
    assert bad.status == "error" and "unsupported" in bad.error


@pytest.mark.parametrize(
    "status, size, outcome",
    [("success", "small", "ok"), ("failure", "large", "error"), ("timeout", "medium", "timeout")],
)
async def test_synthetic_tool_returns_the_drawn_outcome_and_size_class(
    executor: SandboxExecutor, status: str, size: str, outcome: str
) -> None:
    seconds = 9.0 if status == "timeout" else 0.05
    start = time.monotonic()
    out = await executor.execute("synthetic", {"seconds": seconds, "size": size, "status": status}, 0.3)
    took = time.monotonic() - start
    assert (out.status, out.size_class) == (outcome, size)
    assert took < 3.0, "the call's timeout bounds the wait"
    bad = await executor.execute("synthetic", {"seconds": -1, "size": "huge", "status": "ok"})
    assert bad.status == "rejected"


async def test_search(executor: SandboxExecutor) -> None:
    out = await executor.execute("search", {"query": "json module encoder", "k": 3})
    hits = json.loads(out.payload)
    assert out.status == "ok" and len(hits) == 3 and hits[0]["id"] == "stdlib/json"
    assert hits[0]["score"] >= hits[1]["score"]


async def test_shell_pipeline(executor: SandboxExecutor) -> None:
    out = await executor.execute("shell", {"command": "grep -c an | tr -d ' '", "stdin": "banana\nand\nx\n"})
    assert out.status == "ok" and result(out.payload)["stdout"] == "2\n"
    literal = await executor.execute("shell", {"command": "echo $HOME *"})
    assert result(literal.payload)["stdout"] == "$HOME *\n"


async def test_bad_calls_are_rejected_not_raised(executor: SandboxExecutor) -> None:
    cases = [
        ("nope", {"code": "1"}, "unknown tool"),
        ("python", {}, "args.code: required"),
        ("python", {"code": 5}, "expected string"),
        ("python", "print(1)", "expected object"),
        ("python", {"code": "1", "extra": True}, "unknown argument"),
        ("search", {"query": "x", "k": 99}, "above maximum"),
        ("shell", {"command": "rm -rf /"}, "not allowed"),
        ("shell", {"command": "echo a; echo b"}, "not allowed"),
    ]
    for tool, args, fragment in cases:
        out = await executor.execute(tool, args)
        assert out.status == "rejected" and fragment in out.error, (tool, args, out.error)
    negative = await executor.execute("python", {"code": "1"}, timeout_s=-1)
    assert negative.status == "rejected" and "timeout_s" in negative.error


async def test_concurrency_is_bounded_and_pool_is_used(executor: SandboxExecutor) -> None:
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, executor.metrics()["in_flight"])
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(
        *(
            executor.execute("python", {"code": f"import time\ntime.sleep(0.05)\nprint({i})"})
            for i in range(8)
        )
    )
    watcher.cancel()
    assert [result(o.payload)["stdout"] for o in outs] == [f"{i}\n" for i in range(8)]
    assert 1 <= peak <= 2
    metrics = executor.metrics()
    assert metrics["pool"]["hits"] > 0
    assert metrics["tools"]["python"]["by_status"]["ok"] >= 8
    assert metrics["tools"]["python"]["latency_p50_s"] is not None
    assert metrics["in_flight"] == 0 and metrics["queue_depth"] == 0


async def test_full_queue_rejects_with_a_clear_error() -> None:
    ex = SandboxExecutor(SandboxSettings(pool_size=0, max_concurrency=1, max_queue=1))
    await ex.start()
    try:
        outs = await asyncio.gather(
            *(ex.execute("python", {"code": "import time\ntime.sleep(0.3)"}) for _ in range(4))
        )
    finally:
        await ex.close()
    statuses = sorted(o.status for o in outs)
    assert statuses == ["ok", "ok", "rejected", "rejected"]
    assert all("queue full" in o.error for o in outs if o.status == "rejected")


async def test_close_kills_in_flight_calls() -> None:
    ex = SandboxExecutor(SandboxSettings(pool_size=1))
    await ex.start()
    call = asyncio.create_task(ex.execute("python", {"code": "import time\ntime.sleep(30)"}, timeout_s=30))
    await asyncio.sleep(0.3)
    await ex.close()
    out = await asyncio.wait_for(call, 5)
    assert out.status == "killed"
    after = await ex.execute("python", {"code": "print(1)"})
    assert after.status == "rejected"


def test_cli_prints_the_outcome_as_json(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text("print('hello from the sandbox')\n")
    cmd = [sys.executable, "-m", "services.tool_sandbox.cli", "exec", "--tool", "python"]
    done = subprocess.run(
        [*cmd, "--code-file", str(snippet), "--timeout", "5"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "ok" and outcome["size_class"] == "small"
    assert json.loads(outcome["payload"])["stdout"] == "hello from the sandbox\n"
    assert {"payload_bytes", "wall_s", "cpu_s", "peak_rss_bytes", "truncated"} <= set(outcome)
    calc = subprocess.run(
        [sys.executable, "-m", "services.tool_sandbox.cli", "exec", "--tool", "calculator", "--args",
         '{"expression": "6*7"}'],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert calc.returncode == 0 and json.loads(calc.stdout)["payload"] == "42"
    plugin = ["--plugin", str(REPO / "examples" / "custom" / "unit_tool.py")]  # a plugin, tried alone
    conv = subprocess.run(
        [*cmd[:-1], "convert", *plugin, "--args", '{"value": 2, "from": "h", "to": "s"}'],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert conv.returncode == 0, conv.stderr
    assert json.loads(json.loads(conv.stdout)["payload"])["stdout"] == "7200\n"
    bad = subprocess.run(
        [*cmd, "--plugin", str(tmp_path / "none.py")], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "none.py" in bad.stderr


async def test_a_tool_plugin_runs_in_the_sandbox(tmp_path: Path) -> None:
    """examples/custom/unit_tool.py through the real executor: schema-checked arguments, its
    result, its exceptions as `error`, and the sandbox's isolation around it."""
    from services.tool_sandbox.tools.script import ToolPluginError, installed_plugins
    from tests.installed_tool import install_tool_package

    spy = tmp_path / "spy.py"
    spy.write_text(
        "NAME = 'spy'\nDESCRIPTION = 'reads a host file'\nSCHEMA = {'type': 'object'}\n"
        f"def run():\n    return open({str(tmp_path / 'secret.txt')!r}).read()\n"
    )
    (tmp_path / "secret.txt").write_text("host secret")
    ex = SandboxExecutor(
        SandboxSettings(pool_size=1, max_concurrency=1, default_timeout_s=5.0),
        [str(REPO / "examples" / "custom" / "unit_tool.py"), str(spy)],
    )
    await ex.start()
    try:
        assert {"convert", "spy", "python"} <= set(ex.tool_schemas())
        out = await ex.execute("convert", {"value": 2, "from": "h", "to": "s"})
        assert out.status == "ok" and result(out.payload)["stdout"] == "7200\n"
        assert (await ex.execute("convert", {"value": 2, "from": "h"})).status == "rejected"
        assert (await ex.execute("convert", {"value": 2, "from": "h", "to": "parsec"})).status == "rejected"
        mixed = await ex.execute("convert", {"value": 2, "from": "h", "to": "kg"})
        assert mixed.status == "error" and "cannot convert time to mass" in result(mixed.payload)["stderr"]
        spied = await ex.execute("spy", {})
        assert spied.status == "error" and "host secret" not in spied.payload  # the host's files stay out
    finally:
        await ex.close()
    site = tmp_path / "site"
    install_tool_package(site, "convert")
    ex = SandboxExecutor(SandboxSettings(pool_size=1, max_concurrency=1), installed_plugins([str(site)]))
    await ex.start()
    try:  # the same tool from an installed package's `libra.tools` entry point
        out = await ex.execute("convert", {"value": 3, "from": "km", "to": "m"})
        assert out.status == "ok" and result(out.payload)["stdout"] == "3000\n"
    finally:
        await ex.close()
    with pytest.raises(ToolPluginError, match="name of a built-in"):
        clash = tmp_path / "clash.py"
        clash.write_text("NAME = 'python'\nDESCRIPTION = ''\nSCHEMA = {'type': 'object'}\ndef run(): pass\n")
        SandboxExecutor(SandboxSettings(), [str(clash)])
