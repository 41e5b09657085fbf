"""The shared entry point of `python -m services.<name>`: `--help` lists every setting without
importing the service (so no torch), otherwise the service runs under `run_service`."""

from __future__ import annotations

import importlib
import sys

from pydantic_settings import BaseSettings

from services.common.config import CommonSettings


def describe(cls: type[BaseSettings]) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    lines = []
    for name, f in cls.model_fields.items():
        doc = (f.description or "").strip()
        default = f.default if f.default is not None else "-"
        lines.append(f"  {prefix + name.upper():<40} default={default!s:<26} {doc}")
    return "\n".join(lines)


def _load_settings_class(path: str) -> type[BaseSettings]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def service_main(
    service: str, module: str, settings_path: str | None = None, argv: list[str] | None = None
) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: python -m services.{service.replace('-', '_')}\n")
        print(f"Runs the Libra {service} service. Configured through the environment:\n")
        print(describe(CommonSettings))
        if settings_path:
            print(describe(_load_settings_class(settings_path)))
        return 0
    if args:
        print(
            f"unexpected arguments {args}; configure through LIBRA_* variables (see --help)", file=sys.stderr
        )
        return 2
    from services.common.lifecycle import run_service

    return run_service(service, importlib.import_module(module).serve)
