"""A bad config value gives one clear message and exit code 2 — from every service and from
`libra run` — never a traceback, and nothing is started.

Every entry point is started as its own process at least once here (`python -m services.<name>`
without credentials, `python -m tools.cli run` of a missing file, a hidden vLLM, an installed
tool package); the other cases run the same entry points in this process (`tests/in_process.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.common.localstack import Server
from tests.in_process import Exited, libra, service
from tests.installed_tool import install_tool_package

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["planner", "scheduler", "rollout_engine", "trainer", "tool_sandbox"]

pytestmark = pytest.mark.integration


def _run(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")} | env
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=120
    )


def _service(module: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Exited:
    """`python -m services.<module>` in this process."""
    # the engine's process-wide allocator set-up is the process's, not this test runner's
    monkeypatch.setattr("services.rollout_engine.weight_sync.limit_malloc_arenas", lambda: None)
    return service(module, env)


def _libra(args: list[str]) -> Exited:
    """`libra ARGS` in this process, from the repository root."""
    return libra(*args)


@pytest.mark.parametrize("service", SERVICES)
def test_bad_environment_value_exits_2_with_the_field_named(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _service(service, {"LIBRA_LOG_LEVEL": "loud"}, monkeypatch)
    assert out.returncode == 2, out.stderr
    assert "invalid configuration" in out.stderr and "log_level" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_bad_run_config_exits_2_with_the_field_named(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: -3\n")
    out = _service(service, {"LIBRA_CONFIG": str(bad)}, monkeypatch)
    assert out.returncode == 2, out.stderr
    assert "invalid configuration" in out.stderr and "training.steps" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_without_credentials_refuses_to_start(service: str) -> None:
    """A missing secrets mount must not become an unauthenticated service: no credentials and no
    --insecure is exit code 2 with what to do, before anything connects."""
    out = _run(["-m", f"services.{service}"], {"LIBRA_NATS_URL": "nats://127.0.0.1:1"})
    assert out.returncode == 2, out.stderr
    assert "no credentials" in out.stderr and "LIBRA_SECRETS_DIR" in out.stderr and "--insecure" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_worker_with_someone_elses_credentials_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker's secrets, or another kind's: every message would be refused by NATS, so the
    service says which credentials it found and exits 2 before connecting."""
    from services.common.credentials import generate

    creds = generate(tmp_path / "secrets", workers=["rollout-engine-0", "rollout-engine-1", "tool-sandbox"])
    nowhere = {"LIBRA_NATS_URL": "nats://127.0.0.1:1"}
    cases = [
        (
            "rollout_engine",
            "rollout-engine-0",
            {"LIBRA_WORKER_ID": "rollout-engine-1"},
            "of worker 'rollout-engine-0'",
        ),
        ("rollout_engine", "tool-sandbox", {}, "credentials of 'tool-sandbox', not of a rollout-engine"),
        ("tool_sandbox", "tool-sandbox", {"LIBRA_WORKER_ID": "sandbox;rm"}, "worker_id"),
    ]
    for module, identity, env, said in cases:
        secrets = {"LIBRA_SECRETS_DIR": str(creds.identity_dir(identity))}
        out = _service(module, nowhere | secrets | env, monkeypatch)
        assert out.returncode == 2, (module, identity, out.stderr)
        assert said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_insecure_runs_a_service_without_credentials(nats_server: Server) -> None:
    """`--insecure` (development only) starts it without authentication: it joins the control plane."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    env |= {"LIBRA_NATS_URL": nats_server.url, "LIBRA_WORKER_ID": "sandbox-insecure"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tool_sandbox", "--insecure"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(90, proc.kill)  # a service that never gets there fails, not hangs
    watchdog.start()
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "waiting_for_job" in line:
                break
        assert any("waiting_for_job" in line for line in seen), "".join(seen)
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rollout:\n  backend: tpu\n", "rollout.backend"),
        ("task: [1, 2\n", "not valid YAML"),
        ("- just\n- a list\n", "mapping"),
        ("training:\n  lr: fast\n", "training.lr"),
    ],
)
def test_libra_run_rejects_a_bad_config_before_starting_anything(
    text: str, expected: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    runs = tmp_path / "runs"
    out = _libra(["run", str(bad)])
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr
    assert "Traceback" not in out.stderr
    assert not runs.exists()


def test_libra_run_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    out = _run(["-m", "tools.cli", "run", str(tmp_path / "nope.yaml")], {})
    assert out.returncode == 2
    assert "not found" in out.stderr and "Traceback" not in out.stderr


def test_libra_run_tls_files_are_checked_before_anything_connects(tmp_path: Path) -> None:
    tiny = str(ROOT / "configs" / "tiny.yaml")
    remote = ["--nats-url", "nats://127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1/0"]
    out = _libra(["run", tiny, *remote, "--tls-ca-file", str(tmp_path / "ca.pem")])
    assert out.returncode == 2 and "ca_file" in out.stderr and "not a file" in out.stderr, out.stderr
    out = _libra(["run", tiny, "--tls-ca-file", str(tmp_path / "ca.pem")])
    assert out.returncode == 2 and "remote stack" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ("  dataset: {path: nope.jsonl}\n", "nope.jsonl: no such dataset file"),
        ("  dataset: {path: DATA, answer_key: solution}\n", "DATA:2: no key 'solution'"),
        ("  reward: 'no_such_module:score'\n", "ModuleNotFoundError: No module named 'no_such_module'"),
        ("  tools: [calculator, teleport]\n", "task.tools: unknown ['teleport']"),
        ("  tool_plugins: [no_such_tool.py]\n", "no_such_tool.py: cannot read the tool plugin"),
        ("  environment: 'no_such_env:Game'\n", "task.environment 'no_such_env:Game' cannot be loaded"),
    ],
)
def test_a_bad_dataset_or_reward_stops_libra_run_and_config_check(
    task: str, expected: str, tmp_path: Path
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "answer": 1, "solution": 1}\n{"prompt": "b", "answer": 2}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: tiny-random}\ntask:\n" + task.replace("DATA", str(data)))
    expected = expected.replace("DATA", str(data))
    for args in (["run", str(bad), "--run-id", "never"], ["config", "check", str(bad)]):
        out = _libra(args)
        assert out.returncode == 2, out.stderr
        assert expected in out.stderr and "Traceback" not in out.stderr
    assert not (ROOT / "runs" / "never").exists()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            "model: {source: Qwen/NotCachedHere-0.5B}\n",
            "model.source: model.source 'Qwen/NotCachedHere-0.5B': not in the local Hugging Face cache",
        ),
        (
            "model: {source: path, path: /no/such/model}\n",
            "model.path /no/such/model is not a Hugging Face model directory",
        ),
        ("model: {source: tiny-random}\nrollout: {backend: vllm}\n", "rollout.backend: vllm needs vLLM"),
    ],
)
def test_what_run_would_hit_fails_at_config_check_and_before_a_stack_starts(
    config: str, expected: str, tmp_path: Path
) -> None:
    """A model this machine cannot have without a download, or a rollout backend that is not
    installed (vLLM hidden from the interpreter here), stop `config check` and `libra run` with
    exit code 2 and the field named, before anything starts."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None  # as if not installed\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(config)
    env = {"PYTHONPATH": f"{hide}{os.pathsep}{ROOT}", "HF_HUB_CACHE": str(tmp_path / "hf")}
    for args in (["config", "check", str(bad)], ["run", str(bad), "--run-id", "never"]):
        out = _run(["-m", "tools.cli", *args], env, cwd=ROOT)
        assert out.returncode == 2, (args, out.stderr)
        assert expected in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "nats" not in out.stdout + out.stderr  # no stack was started
    assert not (ROOT / "runs" / "never").exists()


def test_the_reward_precheck_gives_the_reward_the_answer_under_answer_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `answer_key: gold`, the pre-check calls the reward with the row's gold answer as the
    plausible response (not an empty one), as the scheduler would score a right answer."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+3?", "gold": 5}\n')
    (tmp_path / "gold_reward.py").write_text(
        "def score(response, sample, trajectory):\n"
        "    if float(response) != sample['gold']:\n"
        "        raise ValueError(f'got {response!r}')\n"
        "    return 1.0\n"
    )
    cfg = tmp_path / "gold.yaml"
    cfg.write_text(
        "model: {source: tiny-random}\n"
        f"task:\n  dataset: {{path: {data}, answer_key: gold}}\n  reward: 'gold_reward:score'\n"
        f"  plugin_paths: [{tmp_path}]\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the plugin path the check adds stays its own
    out = _libra(["config", "check", str(cfg)])
    assert out.returncode == 0, out.stderr


def test_config_check_accepts_the_shipped_custom_example() -> None:
    out = _libra(["config", "check", "configs/custom_example.yaml"])
    assert out.returncode == 0, out.stderr
    assert "48 prompts × 4 samples" in out.stdout


def test_an_installed_package_adds_its_tools(tmp_path: Path) -> None:
    """A `libra.tools` entry point of an installed package is a tool `task.tools` may name."""
    site = tmp_path / "site"
    install_tool_package(site, "convert")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: {source: tiny-random}\ntask:\n  tools: [convert, calculator]\n")
    bare = _libra(["config", "check", str(cfg)])  # the package is not on the path
    assert bare.returncode == 2 and "task.tools: unknown ['convert']" in bare.stderr
    out = _run(["-m", "tools.cli", "config", "check", str(cfg)], {"PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr


def test_config_check_accepts_the_shipped_environment_example() -> None:
    out = _libra(["config", "check", "configs/guess_example.yaml"])
    assert out.returncode == 0, out.stderr
    assert "64 prompts × 4 samples" in out.stdout
