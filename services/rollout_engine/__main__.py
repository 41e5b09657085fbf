"""`python -m services.rollout_engine`: parse settings first, import torch only inside serve."""

from __future__ import annotations

import sys

from services.rollout_engine.config import EngineSettings


def _print_help() -> None:
    from services.common.config import CommonSettings

    print("usage: python -m services.rollout_engine\n\nConfigured by environment variables:\n")
    for cls in (CommonSettings, EngineSettings):
        prefix = cls.model_config.get("env_prefix", "")
        for name, field in cls.model_fields.items():
            doc = (field.description or "").strip()
            print(f"  {(prefix + name).upper():<44} default={field.default!r}")
            if doc:
                print(f"      {doc}")
    print("\nThe run config (LIBRA_CONFIG) gives model and rollout.{backend,max_batch,torch_threads}.")


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        _print_help()
        return 0
    from services.common.lifecycle import run_service
    from services.rollout_engine.weight_sync import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread: bounds the engine's memory during weight pushes
    from services.rollout_engine.service import serve

    return run_service("rollout-engine", serve)


if __name__ == "__main__":
    sys.exit(main())
