"""`python -m tools.k8s_config`: writes deploy/k8s/01-run-config.yaml, the ConfigMap of every run
config in configs/ (mounted at /app/configs; the job, 30-job.yaml, runs `gpu.yaml`). `make docs` runs it and
tests/unit/test_deploy.py fails when the ConfigMap and configs/ disagree."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deploy" / "k8s" / "01-run-config.yaml"
HEADER = (
    "# Generated from configs/ by `python -m tools.k8s_config` (`make docs`); do not edit by hand.\n"
    "# Mounted at /app/configs in every Libra pod; the job (30-job.yaml) runs one (gpu.yaml).\n"
)


class _Literal(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the ConfigMap reads like the files."""


_Literal.add_representer(
    str,
    lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None),
)


def config_map() -> str:
    data = {p.name: p.read_text() for p in sorted((ROOT / "configs").glob("*.yaml"))}
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "libra-run-config", "namespace": "libra"},
        "data": data,
    }
    return HEADER + yaml.dump(doc, Dumper=_Literal, sort_keys=False, width=100)


def main() -> None:
    OUT.write_text(config_map())
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
