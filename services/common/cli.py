"""The shared entry point of `python -m services.<name>`: `--help` lists every setting without
importing the service (so no torch); otherwise the settings are checked (a bad one answers at once)
and the service runs under `run_service`, which parses a pinned job's run config once."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from pydantic_settings import BaseSettings

from services.common.config import CommonSettings, load_settings


def describe(cls: type[BaseSettings]) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    lines = []
    for name, f in cls.model_fields.items():
        doc = (f.description or "").strip()
        default = f.default if f.default is not None else "-"
        lines.append(f"  {prefix + name.upper():<40} default={default!s:<26} {doc}")
    return "\n".join(lines)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def service_main(
    service: str,
    module: str,
    settings_path: str,
    argv: list[str] | None = None,
    *,
    before: str | None = None,
) -> int:
    """`settings_path` (`module:Class`) is the service's settings; `before` (`module:function`) runs
    before the service module is imported (process-wide set-up that must precede any thread)."""
    args = sys.argv[1:] if argv is None else argv
    settings: type[BaseSettings] = _load(settings_path)
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: python -m services.{service.replace('-', '_')} [--insecure]\n")
        print(f"Runs the Libra {service} service. Configured through the environment:\n")
        print(describe(CommonSettings))
        print(describe(settings))
        return 0
    insecure = "--insecure" in args
    args = [a for a in args if a != "--insecure"]
    if args:
        print(
            f"unexpected arguments {args}; configure through LIBRA_* variables (see --help)", file=sys.stderr
        )
        return 2
    if insecure:
        os.environ["LIBRA_INSECURE"] = "1"
    load_settings(settings)
    if before:
        _load(before)()
    from services.common.lifecycle import run_service

    return run_service(service, module)
