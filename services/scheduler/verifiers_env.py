"""verifiers tasksets, run unchanged: `task.dataset: {verifiers: TASKSET}` trains on a `verifiers`
(0.4) taskset's tasks, each trajectory one rollout of a verifiers harness against Libra's
OpenAI-compatible endpoint, rewarded by the task's own `@vf.reward` functions (`Task.score`).

Two sides:

- the scheduler lists the taskset's tasks (`verifiers_tasks`) in a process of its own (`python -m
  services.scheduler.verifiers_env list ...`): the taskset's code runs outside the scheduler, and a
  taskset that hangs or raises is a clear error at start-up;
- the agent workers (`task.agent` defaults to `agent` below) run each task with `vf.Agent`: the
  harness program (verifiers' own `null` chat loop by default, its tools served by the task's MCP
  toolsets) runs as a subprocess under this interpreter. verifiers would fetch the harness's
  dependencies with `uv` from PyPI; they are Libra's own (openai, httpx, mcp, tenacity), so the
  runtime here runs the same program with `sys.executable` instead (`HostRuntime`), offline.

Harnesses that execute model-written code (`bash`, the coding agents) or need a container are
refused: on this runtime they would run on the scheduler's host, outside the tool sandbox.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

from services.common.runconfig import VerifiersDataset
from services.scheduler.datasets import DatasetError
from services.scheduler.task import Task

INSTALL = (
    "pip install --no-deps verifiers==0.4.0 prime-pydantic-config==0.4.3 renderers==0.1.12 "
    "openai-harmony==0.0.8 prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1 "
    "protobuf-py-ext==0.1.1 pyqwest==0.12.0 && pip install -e '.[verifiers]' (make venv does; without "
    "--no-deps, verifiers' openai<3 and mcp==2.0.0 pins would downgrade what Libra and vLLM run on)"
)
LIST_TIMEOUT_S = 300.0
"""Listing a taskset (its `load()`) that has not finished by then is a start-up error."""
_keys = itertools.count()


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise DatasetError(f"verifiers is not installed ({e}): {INSTALL}") from None
    return vf


def _prompt_key(prompt: Any) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:16]


@cache
def _taskset(taskset: str, config_json: str, size: int | None) -> list[Any]:
    """The taskset's first `size` tasks (all: None), loaded once per process (its `load()` must be
    deterministic: the scheduler lists it in one process, the agent workers run it in others)."""
    _vf()
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    config = taskset_config_type(taskset).model_validate({**json.loads(config_json), "id": taskset})
    loaded = load_taskset(config)
    if size is None and not loaded.bounded:
        raise ValueError(f"taskset {taskset!r} yields tasks forever: set task.dataset.size")
    return list(itertools.islice(loaded, size))


def _wire(prompt: Any) -> Any:
    """A task's prompt as JSON: its text, or its messages as dicts."""
    if isinstance(prompt, str | None):
        return prompt
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt]


def _check_harness(harness: str) -> None:
    from verifiers.v1.utils.loaders import harness_class

    cls = harness_class(harness)
    if getattr(cls, "EXECUTES_CODE", False) or getattr(cls, "NEEDS_CONTAINER", False):
        raise ValueError(
            f"harness {harness!r} runs model-written code (or needs a container): on Libra's runtime "
            "it would run on the scheduler's host, outside the tool sandbox; use a chat harness "
            "(null) with the task's own toolsets"
        )


def list_tasks(taskset: str, config: dict[str, Any], harness: str, size: int | None) -> list[dict[str, Any]]:
    """One JSON row per task: what the agent needs to find it again, its prompt and answer."""
    _check_harness(harness)
    rows = []
    for i, task in enumerate(_taskset(taskset, json.dumps(config, sort_keys=True), size)):
        data = task.data
        prompt = _wire(data.prompt)
        rows.append(
            {
                "index": i,
                "prompt": prompt,
                "system_prompt": getattr(data, "system_prompt", None),
                "answer": getattr(data, "answer", None),
                "key": _prompt_key(prompt),
            }
        )
    return rows


def verifiers_tasks(spec: VerifiersDataset, max_turns: int, plugin_paths: list[str]) -> list[Task]:
    """The taskset's tasks as Libra tasks, listed by a process of their own."""
    argv = [sys.executable, "-m", __name__, "list", spec.verifiers, json.dumps(spec.config), spec.harness]
    argv.append(str(spec.size or 0))
    here = str(Path(__file__).resolve().parents[2])  # this Libra, whatever the working directory
    path = [*plugin_paths, here, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=LIST_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise DatasetError(
            f"task.dataset.verifiers {spec.verifiers!r}: listing its tasks took over {LIST_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DatasetError(f"task.dataset.verifiers {spec.verifiers!r}: {why}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if not rows:
        raise DatasetError(f"task.dataset.verifiers {spec.verifiers!r}: the taskset has no tasks")
    made = {
        "taskset": spec.verifiers,
        "config": spec.config,
        "size": spec.size,
        "harness": spec.harness,
        "max_turns": max_turns,
        "paths": plugin_paths,
    }
    tasks = []
    for row in rows:
        prompt, system = row["prompt"], row["system_prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        question = next((str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        sample = {"verifiers": made | {"index": row["index"], "key": row["key"]}, **row}
        tasks.append(
            Task(
                prompt_id=f"vf-{spec.verifiers}-{row['index']}",
                question=question,
                answer=row["answer"],
                messages=tuple(messages),
                sample=sample,
            )
        )
    return tasks


@cache
def _host_runtime_class() -> type:
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    class HostRuntime(SubprocessRuntime):  # type: ignore[misc]
        """verifiers' subprocess runtime, running a harness's script with this interpreter (whose
        packages the script's declared ones are) instead of `uv` fetching them."""

        async def prepare_uv_script(
            self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True
        ) -> list[str]:
            data = script.encode() if isinstance(script, str) else script
            path = f"{self.workdir}/{hashlib.sha256(data).hexdigest()}.py"
            await self.write(path, data)
            return [sys.executable, path]

    return HostRuntime


def _on_path(paths: list[str]) -> None:
    """The taskset's directories on the import path of the programs verifiers starts (its MCP
    toolsets run as `python -m MODULE`), as on this process's."""
    have = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    missing = [p for p in paths if p not in have]
    if missing:
        os.environ["PYTHONPATH"] = os.pathsep.join([*missing, *filter(None, have)])


async def agent(sample: dict[str, Any], base_url: str, api_key: str) -> float:
    """One rollout of the row's task: its harness against Libra's endpoint, scored by the task."""
    vf = _vf()
    made = sample["verifiers"]
    tasks = _taskset(made["taskset"], json.dumps(made["config"], sort_keys=True), made["size"])
    _on_path(made["paths"])
    index = made["index"]
    if index >= len(tasks) or _prompt_key(_wire(tasks[index].data.prompt)) != made["key"]:
        raise RuntimeError(
            f"taskset {made['taskset']!r} loads differently here than when the scheduler listed it "
            f"(task {index}): its load() must give the same tasks in the same order every time"
        )
    # The trajectory's key travels in a variable of this process only: verifiers reads the key
    # from the environment, and drops names with API_KEY from what its programs inherit.
    var = f"LIBRA_VF_API_KEY_{next(_keys)}"
    os.environ[var] = api_key
    config = vf.AgentConfig(
        model="policy",
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=var),
        harness={"id": made["harness"]},
        runtime=vf.SubprocessConfig(),
        max_turns=made["max_turns"],
    )
    runtime = _host_runtime_class()(vf.SubprocessConfig())
    try:
        await runtime.start()
        async with vf.Agent(config) as running:
            trace = await running.run(tasks[index], runtime=runtime)
    finally:
        os.environ.pop(var, None)
        await runtime.teardown()
    if not trace.ok:
        errors = "; ".join(f"{e.type}: {e.message}"[:500] for e in trace.errors) or "not ok"
        raise RuntimeError(f"the verifiers rollout failed: {errors}")
    return float(trace.reward)


def main(argv: list[str]) -> int:
    """`python -m services.scheduler.verifiers_env list TASKSET CONFIG_JSON HARNESS SIZE` (0: all)."""
    if argv[:1] != ["list"] or len(argv) != 5:
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        rows = list_tasks(argv[1], json.loads(argv[2]), argv[3], int(argv[4]) or None)
    except DatasetError as e:
        print(e, file=sys.stderr)
        return 1
    except Exception as e:  # the taskset's code may raise anything
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for row in rows:
        print(json.dumps(row, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
